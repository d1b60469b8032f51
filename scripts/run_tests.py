"""Run the test suite as one pytest process per top-level test folder (plus one for the
files directly under tests/).

Folders run `jobs()` at a time (default: one per CPU core): most of a test's time is XLA
compiling on one core, so two folders side by side use a 2-core machine's second core.

Why separate processes: hundreds of XLA compilations (CPU programs, TPU/CUDA
cross-lowerings, Pallas interpret-mode kernels) accumulated in a single process crashed
XLA:CPU's compiler with a segfault late in the suite, while every folder passes on its own.
Separate processes keep each folder's compiled state apart; the cost is a few seconds of
start-up per folder.

    python scripts/run_tests.py -m "not slow" [more pytest args]

Prints each folder's five slowest tests and pytest summary, then one closing line
'N passed, N failed in M min'; exits non-zero if any folder failed or crashed.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def groups() -> list[list[str]]:
    tests = ROOT / "tests"
    folders = sorted(p for p in tests.iterdir() if p.is_dir() and any(p.rglob("test_*.py")))
    files = sorted(p for p in tests.glob("test_*.py"))
    return [[str(p.relative_to(ROOT))] for p in folders] + [[str(p.relative_to(ROOT))
                                                             for p in files]]


def run_group(group: list[str], argv: list[str]) -> tuple[list[str], int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "--durations=5", *argv, *group]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    return group, proc.returncode, proc.stdout


def jobs() -> int:
    """Folders run side by side: XLA compiles (most of a test's time) use one core each.
    SERVAX_TEST_JOBS overrides (1 = one folder at a time)."""
    return max(1, int(os.environ.get("SERVAX_TEST_JOBS", os.cpu_count() or 1)))


def main(argv: list[str]) -> int:
    totals = {"passed": 0, "failed": 0, "error": 0}
    bad = []
    start = time.perf_counter()
    # the largest folders first, so the last to finish is a short one
    todo = sorted(groups(), key=lambda g: -sum(f.stat().st_size for p in g
                                               for f in (ROOT / p).rglob("test_*.py")
                                               if (ROOT / p).is_dir())
                  - sum((ROOT / p).stat().st_size for p in g if (ROOT / p).is_file()))
    with concurrent.futures.ThreadPoolExecutor(jobs()) as pool:
        for future in concurrent.futures.as_completed(
                [pool.submit(run_group, g, argv) for g in todo]):
            group, code, out = future.result()
            summary = next((line for line in reversed(out.splitlines())
                            if re.search(r"\d+ (passed|failed|error|deselected)", line)), "")
            slowest = re.findall(r"^\d+\.\d+s (?:call|setup|teardown) .*$", out, re.M)
            print(f"== {' '.join(group)}", flush=True)
            print(out[-6000:] if code not in (0, 5) else
                  "\n".join(["  slowest: " + line for line in slowest] + [summary]),
                  flush=True)
            for key in totals:
                m = re.findall(rf"(\d+) {key}", summary)
                totals[key] += int(m[-1]) if m else 0
            if code not in (0, 5):  # 5: every test of the folder deselected
                bad.append(f"{' '.join(group)} (exit {code})")
    failed = totals["failed"] + totals["error"] + (len(bad) if not totals["failed"] +
                                                   totals["error"] else 0)
    if bad:
        print("failed or crashed: " + "; ".join(bad))
    print(f"{totals['passed']} passed, {failed} failed in "
          f"{(time.perf_counter() - start) / 60:.1f} min ({jobs()} folders at a time)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
