import math
import time

import jax.numpy as jnp
import pytest

from research.core.timing import geomean, time_fn, time_interleaved


def test_time_fn_warms_up_then_times_each_repeat():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.01)
        return jnp.ones(3)

    t = time_fn(fn, warmup=2, repeats=3)
    assert len(calls) == 5
    assert len(t["times_s"]) == 3
    assert t["min_s"] <= t["median_s"] <= max(t["times_s"])
    assert t["min_s"] >= 0.009


def test_time_interleaved_rounds_and_alternation():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    times = time_interleaved(fns, warmup=1, repeats=3, alternate=True)
    assert order == list("abc") + list("abc") + list("cba") + list("abc")
    for name in "abc":
        assert len(times[name]["wall_s"]) == len(times[name]["cpu_s"]) == 3
    order.clear()
    time_interleaved(fns, warmup=0, repeats=2)
    assert order == list("abcabc")


@pytest.mark.parametrize("kwargs, match", [
    ({"warmup": -1}, "warmup"), ({"repeats": 0}, "repeats"), ({"repeats": 1.5}, "repeats")])
def test_time_interleaved_rejects_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        time_interleaved({"f": lambda: None}, **kwargs)
    with pytest.raises(ValueError, match="fns"):
        time_interleaved({})


def test_geomean():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean([3.0]) == pytest.approx(3.0)
    assert geomean([2.0, 0.0]) == 0.0
    assert math.isnan(geomean([2.0, float("nan")]))
    for bad in ([], [2.0, -1.0]):
        with pytest.raises(ValueError, match="geomean"):
            geomean(bad)
