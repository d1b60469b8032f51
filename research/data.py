"""Evaluation and calibration text: the English prose of `pydoc_data.topics`.

Topics are split deterministically: walking them in sorted-name order, the topics that
start in every 4th stretch of 20k prose characters are held out for evaluation (about a
quarter of the text), the rest is calibration/training text, so no technique calibrates on the
text it is scored on. Prose only: indented blocks (code, grammar rules), heading
underlines and doctest lines are dropped and hard-wrapped paragraphs are re-joined.
"""
from __future__ import annotations

import re
from pathlib import Path

SPLITS = ("calibration", "heldout", "all")
HELDOUT_EVERY = 4
STRETCH_CHARS = 20_000
_UNDERLINE = re.compile(r"^[*=\-~^\"]{3,}\s*$")


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of plain prose in a pydoc topic, each on one line."""
    paragraphs, current = [], []
    for line in text.splitlines():
        is_prose = line.strip() and not line[0].isspace() and not _UNDERLINE.match(line)
        if is_prose and not line.startswith(">>>"):
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return [p for p in paragraphs if len(p.split()) >= 5]  # drop headings and stubs


def topic_names(split: str) -> list[str]:
    from pydoc_data.topics import topics
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    names = sorted(topics)
    if split == "all":
        return names
    chosen, offset = [], 0
    for name in names:
        held = (offset // STRETCH_CHARS) % HELDOUT_EVERY == HELDOUT_EVERY - 1
        if held == (split == "heldout"):
            chosen.append(name)
        offset += sum(len(p) for p in prose_paragraphs(topics[name]))
    return chosen


def corpus_text(split: str = "heldout") -> str:
    """The prose of a split, topics in sorted order, paragraphs separated by blank lines."""
    from pydoc_data.topics import topics
    paras = [p for name in topic_names(split) for p in prose_paragraphs(topics[name])]
    return "\n\n".join(paras)


def load_text(path: str | None, split: str = "heldout") -> str:
    """Text of a file when `path` is given, else the default corpus split."""
    if not path:
        return corpus_text(split)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"text file {p} is not UTF-8: byte {e.object[e.start]:#04x} at "
                         f"offset {e.start} ({e.reason}); expected UTF-8 text (convert it, "
                         f"e.g. iconv -f latin1 -t utf-8)") from None
    if not text.strip():
        raise ValueError(f"text file {p} is empty")
    return text
