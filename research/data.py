"""Evaluation and calibration text: the English prose of `pydoc_data.topics`.

Topics are split deterministically: walking them in sorted-name order, the topics that
start in every 4th stretch of 20k prose characters are held out for evaluation (about a
quarter of the text), the rest is calibration/training text, so no technique calibrates on the
text it is scored on. The held-out topics are split once more, by a hash of each topic's
name (`research.core.splits.split_of`, salt `TEXT_SALT`), into a **dev** half (where defaults
are chosen) and a **test** half (scored with the final defaults); the three are disjoint
by construction and `check_text_splits` raises if they ever overlap (docs/protocol.md). Prose only: indented blocks (code, grammar rules), heading
underlines and doctest lines are dropped and hard-wrapped paragraphs are re-joined.
"""
from __future__ import annotations

import re
from pathlib import Path

from research.core.splits import check_disjoint, split_of

SPLITS = ("calibration", "heldout", "dev", "test", "all")
# the first salt of text-0..9 that halves the held-out prose (28k / 27k characters);
# chosen from the topic sizes alone, before any technique was scored on either half
TEXT_SALT = "text-2"
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
        if held == (split != "calibration"):
            chosen.append(name)
        offset += sum(len(p) for p in prose_paragraphs(topics[name]))
    if split in ("dev", "test"):
        chosen = [n for n in chosen if split_of(n, TEXT_SALT) == split]
    return chosen


def check_text_splits() -> None:
    """Raise SplitOverlapError if calibration, dev and test topics share a topic."""
    cal, dev, test = (topic_names(s) for s in ("calibration", "dev", "test"))
    check_disjoint(dev, test, what="held-out text topics")
    check_disjoint(cal, dev, what="text topics", names=("calibration", "dev"))
    check_disjoint(cal, test, what="text topics", names=("calibration", "test"))


def corpus_text(split: str = "heldout") -> str:
    """The prose of a split, topics in sorted order, paragraphs separated by blank lines.
    "dev" / "test" are the two disjoint halves of "heldout" (checked on every call)."""
    from pydoc_data.topics import topics
    if split in ("dev", "test"):
        check_text_splits()
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
