"""Wall-clock timing and the geometric mean: the one copy experiments, scripts and the
library use (DESIGN.md, numbers discipline: warm up, block_until_ready, medians, A vs B
in the same process)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np


def time_interleaved(fns: Mapping[Any, Callable[[], Any]], *, warmup: int = 1,
                     repeats: int = 3, alternate: bool = False) -> dict:
    """Times every `fn()` (its result blocked on) in rounds, one call of each per round.

    `warmup` untimed rounds come first (compilation). Interleaving makes a shared
    machine's load drift hit all variants alike; `alternate` reverses the order every
    other round (A B C, C B A, ...) so no variant always runs first.
    Returns {name: {"wall_s": [seconds per round], "cpu_s": [process CPU seconds]}};
    process CPU time counts only this process's threads, so it is far less sensitive to
    other jobs on a shared machine than wall time.
    """
    if not fns:
        raise ValueError("fns must name at least one function to time, got none")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            jax.block_until_ready(fns[name]())
    times = {name: {"wall_s": [], "cpu_s": []} for name in names}
    for r in range(repeats):
        for name in (names[::-1] if alternate and r % 2 else names):
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fns[name]())
            times[name]["wall_s"].append(time.perf_counter() - w0)
            times[name]["cpu_s"].append(time.process_time() - c0)
    return times


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 3) -> dict:
    """Median / min wall seconds of `fn()` (its result blocked on) after warm-up calls:
    {"median_s", "min_s", "times_s"}."""
    times = time_interleaved({"fn": fn}, warmup=warmup, repeats=repeats)["fn"]["wall_s"]
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def geomean(xs: Sequence[float]) -> float:
    """Geometric mean of non-negative numbers (speedup ratios). A NaN propagates (as in a
    plain mean: a ratio that could not be measured makes the summary NaN, not an error);
    a zero gives 0."""
    a = np.asarray(xs, np.float64).reshape(-1)
    if a.size == 0:
        raise ValueError("geomean needs at least one value, got none")
    if np.any(a < 0):
        raise ValueError(f"geomean needs non-negative values, got {a.tolist()}")
    with np.errstate(divide="ignore"):
        return float(np.exp(np.mean(np.log(a))))
