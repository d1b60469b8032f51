"""The transform protocol: chain semantics, identity, the bf16 KV-cache transform."""
import jax.numpy as jnp
import numpy as np
import pytest

from research.kv.codec import FloatCodec
from research.eval.perplexity import perplexity
from research.kv.dense import DenseKVCache
from research.model.precision import kv_cache_dtype, weights_dtype
from research.transforms import (CalibrationData, Transform, calibrate_and_apply, chain,
                                 frozen, identity, stateless)


def _recording(name, log):
    """A transform that records which model it calibrated on and tags its output."""
    def calibrate(model, data):
        log.append((name, model.tags))
        return {"seen": len(model.tags)}

    def apply(model, state):
        return model.replace(tags=model.tags + (f"{name}{state['seen']}",))
    return Transform(calibrate, apply, name)


def test_chain_calibrates_each_on_previous_output(tiny):
    log = []
    t = chain(_recording("a", log), _recording("b", log))
    model, state = calibrate_and_apply(t, tiny, None)
    assert log == [("a", ()), ("b", ("a0",))]
    assert model.tags == ("a0", "b1")
    assert t.apply(tiny, state).tags == model.tags  # apply alone reproduces calibrate
    assert t.name == "a+b"


def test_identity_and_empty_chain(tiny):
    assert calibrate_and_apply(identity(), tiny, None)[0] is tiny
    assert calibrate_and_apply(chain(), tiny, None)[0] is tiny


def test_frozen_reuses_an_earlier_calibration(tiny):
    log = []
    first = _recording("a", log)
    state = first.calibrate(tiny, None)
    model, chained = calibrate_and_apply(chain(frozen(first, state), _recording("b", log)),
                                         tiny, None)
    assert log == [("a", ()), ("b", ("a0",))]  # "a" was not calibrated again
    assert chained[0] is state and model.tags == ("a0", "b1")


def test_chain_state_length_checked(tiny):
    with pytest.raises(ValueError, match="2 transforms got 1 states"):
        chain(identity(), identity()).apply(tiny, ((),))


def test_kv_cache_dtype(tiny):
    model, _ = calibrate_and_apply(kv_cache_dtype("bfloat16"), tiny, None)
    assert all(c == DenseKVCache(FloatCodec("bfloat16")) for c in model.caches)
    assert model.init_cache(1, 4)[0]["k"].dtype == jnp.bfloat16
    ids = np.random.default_rng(0).integers(0, 97, 33)
    a, b = perplexity(tiny, ids, window=16), perplexity(model, ids, window=16)
    assert a.ppl != b.ppl and abs(a.ppl / b.ppl - 1) < 0.01
    with pytest.raises(ValueError, match="dtype"):
        kv_cache_dtype("int4")


def test_weights_dtype(tiny):
    model, _ = calibrate_and_apply(weights_dtype("bfloat16"), tiny, None)
    assert model.params["layers"][0]["wq"].dtype == jnp.bfloat16


def test_calibration_data():
    data = CalibrationData.from_ids(list(range(100)), seq_len=10, n_seqs=3)
    assert data.tokens.shape == (3, 10) and int(data.tokens[1, 0]) == 10
    with pytest.raises(ValueError, match="need seq_len\\*n_seqs=200"):
        CalibrationData.from_ids(list(range(100)), seq_len=100, n_seqs=2)
    with pytest.raises(ValueError, match="empty sequence"):
        CalibrationData(jnp.zeros((2, 4), jnp.int32), jnp.array([4, 0])).validate()


def test_stateless_has_an_empty_state_and_checks_its_arguments(tiny):
    t = stateless(lambda model, state: model.replace(tags=model.tags + ("s",)), "tagger")
    model, state = calibrate_and_apply(t, tiny, None)
    assert state == () and model.tags == ("s",) and t.name == "tagger"
    with pytest.raises(TypeError, match="apply must be callable"):
        stateless("not a function", "x")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        stateless(lambda model, state: model, "")


def test_chain_rejects_what_is_not_a_transform():
    with pytest.raises(TypeError, match="argument 1 must be a Transform"):
        chain(identity(), lambda model: model)


def test_calibration_data_of_one_context():
    data = CalibrationData.from_context([5, 6, 7])
    assert data.tokens.shape == (1, 3) and int(data.lengths[0]) == 3
    with pytest.raises(ValueError, match="non-empty 1-D"):
        CalibrationData.from_context([])
