"""KV rollback: rejected tokens vanish by not advancing the length (dense, widened rings)."""
import jax
import pytest

from research.kv.window import WindowKVCache
from research.model import init_params, make_model, tiny_config
from research.specdecode import check_rollback, with_rollback_slack


def _windowed():
    config = tiny_config(n_layers=2).with_interleaved_attention(window=6, globals_every=2)
    return make_model(config, init_params(config, jax.random.key(0)))


def test_dense_cache_rolls_back(tiny):
    check_rollback(tiny, max_draft=4)  # raises if a rejected chunk leaks into attention


def test_plain_ring_cannot_roll_back_and_slack_fixes_it():
    model = _windowed()
    with pytest.raises(ValueError, match="with_rollback_slack"):
        check_rollback(model, max_draft=4)
    widened = with_rollback_slack(model, 4)
    assert isinstance(widened.caches[0], WindowKVCache) and widened.caches[0].window == 10
    assert widened.caches[1] == model.caches[1]  # the global layer's dense cache as is
    check_rollback(widened, max_draft=4)
    with pytest.raises(ValueError, match="max_draft"):
        with_rollback_slack(model, -1)
