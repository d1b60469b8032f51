"""Dev / test splits that are disjoint by construction, and the guard that checks it.

One protocol for every technique (docs/protocol.md): defaults are chosen on a **dev**
split, the **test** split is scored with the final defaults, and no item (a text window,
an arithmetic problem, a prompt) is in both.

Disjoint by construction: an item's split is a function of the item itself, never of the
order or seed it was drawn with. `split_of(key, salt)` hashes the item's canonical key
(its content: a problem's numbers, a prompt's text, a topic's name) with a per-technique
`salt` into one of `SPLITS`, so two seeds can draw the same problem but only one split can
hold it. `take(stream, split, n, key=...)` keeps the first n distinct items of a stream
that belong to `split`. Where a split is a hand-written list (prompts) instead,
`Splits(dev, test)` refuses overlapping lists (`SplitOverlapError`), comparing the items'
keys, and `check_disjoint` does the same for any two collections (the calibration text vs
the dev / test text, for example).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Hashable, Iterable, Sequence

SPLITS = ("dev", "test")


class SplitOverlapError(ValueError):
    """A dev item is also a test item (or any two splits that must be disjoint share one)."""


def canonical_key(item: Any) -> str:
    """A stable text key for an item: str as is, anything else by repr (tuples of ints,
    frozen dataclasses)."""
    return item if isinstance(item, str) else repr(item)


def split_of(key: str, salt: str, dev_fraction: float = 0.5) -> str:
    """'dev' or 'test' for an item key, from a hash of (salt, key): deterministic,
    independent of draw order and seed, so a key lands in exactly one split."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str (use canonical_key(item)), got {type(key).__name__}")
    if not salt:
        raise ValueError("salt must be a non-empty string naming the technique's split")
    if not 0.0 < dev_fraction < 1.0:
        raise ValueError(f"dev_fraction must be in (0, 1), got {dev_fraction}")
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "dev" if u < dev_fraction else "test"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def take(stream: Iterable, split: str, n: int, *, salt: str,
         key: Callable[[Any], str] = canonical_key, dev_fraction: float = 0.5,
         max_draws: int | None = None) -> list:
    """The first n distinct items of `stream` (by key) that belong to `split`.

    Raises ValueError when the stream ends (or `max_draws` items were drawn, default
    1000 n + 1000) before n items of the split were found.
    """
    _check_split(split)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    limit = max_draws if max_draws is not None else 1000 * n + 1000
    out, seen, draws = [], set(), 0
    for item in stream:
        if draws >= limit:
            break
        draws += 1
        k = key(item)
        if k in seen or split_of(k, salt, dev_fraction) != split:
            continue
        seen.add(k)
        out.append(item)
        if len(out) == n:
            return out
    raise ValueError(f"found {len(out)} of the {n} requested {split!r} items of {salt!r} in "
                     f"{draws} draws: the item space is too small for n (widen the task's "
                     "ranges or lower n)")


def check_disjoint(a: Iterable, b: Iterable, *, what: str, names: tuple[str, str] = ("dev",
                   "test"), key: Callable[[Any], Hashable] = canonical_key) -> None:
    """Raise SplitOverlapError naming the shared items when `a` and `b` share a key."""
    ka = {key(x): x for x in a}
    shared = [ka[k] for k in dict.fromkeys(key(x) for x in b) if k in ka]
    if shared:
        shown = ", ".join(repr(x)[:80] for x in shared[:3])
        raise SplitOverlapError(f"{what}: {len(shared)} item(s) are in both the {names[0]} and "
                                f"the {names[1]} split, e.g. {shown}; the splits must be "
                                "disjoint")


@dataclasses.dataclass(frozen=True)
class Splits:
    """A technique's dev and test items (hand-written lists, e.g. prompts); construction
    raises SplitOverlapError if they share an item, ValueError if either is empty."""

    what: str
    dev: Sequence
    test: Sequence

    def __post_init__(self):
        for name in SPLITS:
            if not len(getattr(self, name)):
                raise ValueError(f"{self.what}: the {name} split is empty")
        check_disjoint(self.dev, self.test, what=self.what)

    def __getitem__(self, split: str) -> Sequence:
        _check_split(split)
        return getattr(self, split)
