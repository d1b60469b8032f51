"""Run the test suite as one pytest process per top-level test folder (plus one for the
files directly under tests/).

Why: hundreds of XLA compilations (CPU programs, TPU/CUDA cross-lowerings, Pallas
interpret-mode kernels) accumulated in a single process crashed XLA:CPU's compiler with a
segfault late in the suite, while every folder passes on its own. Separate processes keep
each folder's compiled state apart; the cost is a few seconds of start-up per folder.

    python scripts/run_tests.py -m "not slow" [more pytest args]

Prints each folder's pytest summary, then one closing line 'N passed, N failed'; exits
non-zero if any folder failed or crashed.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def groups() -> list[list[str]]:
    tests = ROOT / "tests"
    folders = sorted(p for p in tests.iterdir() if p.is_dir() and any(p.rglob("test_*.py")))
    files = sorted(p for p in tests.glob("test_*.py"))
    return [[str(p.relative_to(ROOT))] for p in folders] + [[str(p.relative_to(ROOT))
                                                             for p in files]]


def main(argv: list[str]) -> int:
    totals = {"passed": 0, "failed": 0, "error": 0}
    bad = []
    for group in groups():
        cmd = [sys.executable, "-m", "pytest", "-q", *argv, *group]
        print(f"== {' '.join(group)}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        summary = next((line for line in reversed(proc.stdout.splitlines())
                        if re.search(r"\d+ (passed|failed|error|deselected)", line)), "")
        print(proc.stdout[-6000:] if proc.returncode not in (0, 5) else summary, flush=True)
        for key in totals:
            m = re.findall(rf"(\d+) {key}", summary)
            totals[key] += int(m[-1]) if m else 0
        if proc.returncode not in (0, 5):  # 5: every test of the folder deselected
            bad.append(f"{' '.join(group)} (exit {proc.returncode})")
    failed = totals["failed"] + totals["error"] + (len(bad) if not totals["failed"] +
                                                   totals["error"] else 0)
    if bad:
        print("failed or crashed: " + "; ".join(bad))
    print(f"{totals['passed']} passed, {failed} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
