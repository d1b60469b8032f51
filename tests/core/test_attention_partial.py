"""Online-softmax partials (research/core/attention.py): any split of the slots into
disjoint masked parts, any block size, merges to the reference attention's output."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.core.attention import attend, attention_mask, attention_partial, merge_partials


@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_partials_over_disjoint_slots_merge_to_the_reference(block):
    b, t, s, hq, hkv, d = 2, 6, 23, 4, 2, 8
    ks = jax.random.split(jax.random.key(block), 4)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k = jax.random.normal(ks[1], (b, s, hkv, d))
    v = jax.random.normal(ks[2], (b, s, hkv, d))
    q_pos = jnp.broadcast_to(jnp.arange(s - t, s)[None], (b, t))
    kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    valid = kv_pos < jnp.array([[s], [s - 3]])
    want = attend(q, k, v, q_pos, kv_pos, valid)
    mask = attention_mask(q_pos, kv_pos, valid, None)
    split = jax.random.bernoulli(ks[3], 0.5, (b, t, s))  # any per-query split of the slots
    got = merge_partials((attention_partial(q, k, v, mask & split, block),
                          attention_partial(q, k, v, mask & ~split, block)), q.dtype)
    np.testing.assert_allclose(got, want, atol=2e-6)
    one = merge_partials((attention_partial(q, k, v, mask, block),), q.dtype)
    np.testing.assert_allclose(one, want, atol=2e-6)


def test_a_query_with_nothing_unmasked_gets_zeros_not_nan():
    q, k = jnp.ones((1, 2, 2, 4)), jnp.ones((1, 3, 1, 4))
    mask = jnp.array([[[True, False, False], [False, False, False]]])
    out = merge_partials((attention_partial(q, k, k, mask, 2),
                          attention_partial(q, k, k, jnp.zeros_like(mask), 2)), q.dtype)
    assert np.all(np.isfinite(out)) and np.all(np.asarray(out[0, 1]) == 0)
    np.testing.assert_allclose(out[0, 0], 1.0)
