"""Evaluation and calibration text: the English prose of `pydoc_data.topics`.

Topics are split deterministically: walking them in sorted-name order, the topics that
start in every 4th stretch of 20k prose characters are held out for evaluation (about a
quarter of the text), the rest is calibration/training text, so no technique calibrates on the
text it is scored on. The held-out topics are split once more, by a hash of each topic's
name (`research.core.splits.split_of`, salt `TEXT_SALT`), into a **dev** half (where defaults
are chosen) and a **test** half (scored with the final defaults); the three are disjoint
by construction and `check_text_splits` raises if they ever overlap (docs/protocol.md). Prose only: indented blocks (code, grammar rules), heading
underlines and doctest lines are dropped and hard-wrapped paragraphs are re-joined.

**Fresh test text** (`corpus_text("test", text="stdlib")`): the pydoc held-out half has been
scored through several rounds of defaults, and its topics repeat paragraphs of the dev and
calibration topics. Headline claims are re-scored once on text no run had seen: the prose
paragraphs of the docstrings of a fixed list of standard-library modules (`STDLIB_MODULES`,
read from the source files of the standard library with `ast`, nothing imported), any paragraph sharing a run of
`SHINGLE_WORDS` words with the pydoc prose dropped, so it is disjoint from every pydoc
split by construction. It is test text only (dev stays the pydoc dev half); its sha256 on
the CPython it was registered with (`STDLIB_TEXT_SHA256`) is checked on every read, so a
number scored on another Python's docstrings cannot pass as the registered text.
"""
from __future__ import annotations

import re
from pathlib import Path

import ast
import hashlib
import sys
import sysconfig

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


TEXTS = ("pydoc", "stdlib")
STDLIB_MODULES = (
    "argparse", "asyncio.events", "asyncio.tasks", "collections", "concurrent.futures._base",
    "contextlib", "csv", "dataclasses", "difflib", "email.message", "enum", "fractions",
    "functools", "heapq", "http.client", "http.server", "inspect", "logging",
    "logging.handlers", "pathlib", "pickle", "pprint", "shutil", "statistics", "string",
    "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest.case",
    "unittest.mock", "urllib.parse", "urllib.request", "zipfile", "_pydecimal", "ftplib",
    "imaplib", "smtplib", "socketserver", "tempfile", "timeit", "traceback", "warnings",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "configparser", "calendar",
    "codecs", "copy", "datetime", "glob", "gettext", "ipaddress", "json.decoder",
    "json.encoder", "locale", "mailbox", "optparse", "os", "queue", "random", "sched",
    "shlex", "signal", "ssl", "turtle", "uuid", "zipimport")
SHINGLE_WORDS = 10
# sha256 of stdlib_text() on the CPython it was registered with (set before any scoring)
STDLIB_TEXT_PYTHON = "3.11.7"
STDLIB_TEXT_SHA256 = "8f843a49e3db4f5ebeba6a87ed00e12b9babecef3c44bf1c9c711fc9c898e202"


def docstring_paragraphs(source: str) -> list[str]:
    """Prose paragraphs of every docstring (module, class, function) of Python `source`:
    blocks without indented, doctest or continuation lines, at least 8 words, ending a
    sentence; hard-wrapped lines re-joined."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        for block in re.split(r"\n\s*\n", doc or ""):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text.split()) >= 8 and text[-1] in ".!?":
                out.append(text)
    return out


def _shingles(text: str) -> set[str]:
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i:i + SHINGLE_WORDS])
            for i in range(max(0, len(words) - SHINGLE_WORDS + 1))}


def stdlib_text(check: bool = True) -> str:
    """The fresh test text (module docstring): docstring prose of STDLIB_MODULES, each
    paragraph once, none sharing a SHINGLE_WORDS-word run with any pydoc split.
    check: raise unless it is the registered text (STDLIB_TEXT_SHA256)."""
    from pydoc_data.topics import topics
    pydoc = set().union(*(_shingles(p) for t in topics.values() for p in prose_paragraphs(t)))
    paras, seen = [], set()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_MODULES:
        base = stdlib.joinpath(*name.split("."))
        path = next((p for p in (base.with_suffix(".py"), base / "__init__.py")
                     if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"standard-library module {name!r} has no Python "
                                    f"source under {stdlib}; the fresh test text needs it")
        with open(path, encoding="utf-8") as f:
            for p in docstring_paragraphs(f.read()):
                if p not in seen and not (_shingles(p) & pydoc):
                    seen.add(p)
                    paras.append(p)
    text = "\n\n".join(paras)
    digest = hashlib.sha256(text.encode()).hexdigest()
    if check and digest != STDLIB_TEXT_SHA256:
        raise ValueError(
            f"the fresh test text read on Python {sys.version.split()[0]} has sha256 "
            f"{digest[:16]}..., not the registered {STDLIB_TEXT_SHA256[:16]}... (Python "
            f"{STDLIB_TEXT_PYTHON}): scores on it would not be comparable; run on Python "
            f"{STDLIB_TEXT_PYTHON}")
    return text


def split_text(split: str, text: str = "pydoc") -> str:
    """What a dev or test run reads: the pydoc half of `split`, or, for a test run with
    text="stdlib", the fresh test text (module docstring; dev stays pydoc's dev half)."""
    if text not in TEXTS:
        raise ValueError(f"text must be one of {TEXTS}, got {text!r}")
    if split not in ("dev", "test"):
        raise ValueError(f"split must be 'dev' or 'test', got {split!r}")
    if text == "stdlib":
        if split != "test":
            raise ValueError("the fresh 'stdlib' text is test text only; dev runs read the "
                             "pydoc dev half")
        return stdlib_text()
    return corpus_text(split)


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
