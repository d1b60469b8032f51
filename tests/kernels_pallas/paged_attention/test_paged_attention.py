"""Paged decode attention kernels vs the plain-JAX reference (interpret mode) + lowering."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import api
from research.kv.paged import paged_kv_cache
from research.serving.generate import generate
from research.transforms import calibrate_and_apply


def _inputs(seed, b=3, hq=6, hkv=2, d=16, s=8, n=14, m=4, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(hkv, n, s, d)), dtype)
    v = jnp.asarray(rng.normal(size=(hkv, n, s, d)), dtype)
    table = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)
    table[-1, -1] = -1  # an unmapped tail entry
    lengths = np.asarray([m * s - 5, m * s, (m - 1) * s][:b], np.int32)
    return q, k, v, jnp.asarray(table), jnp.asarray(lengths)


@pytest.mark.parametrize("backend", ["tpu", "triton"])
@pytest.mark.parametrize("window", [None, 11])
def test_kernel_matches_reference(backend, window):
    args = _inputs(seed=hash((backend, window)) % 1000)
    want = api.paged_decode_attention(*args, window=window)
    got = api.paged_decode_attention(*args, window=window, implementation="pallas",
                                     backend=backend, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["tpu", "triton"])
def test_kernel_bf16_and_empty_row(backend):
    q, k, v, table, lengths = _inputs(seed=7, dtype=jnp.bfloat16)
    lengths = lengths.at[0].set(0)  # attends to nothing -> zeros, not NaN
    want = api.paged_decode_attention(q, k, v, table, lengths)
    got = api.paged_decode_attention(q, k, v, table, lengths, implementation="pallas",
                                     backend=backend, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)
    assert not np.any(np.asarray(got[0], np.float32))


@pytest.mark.parametrize("backend,platform", [("tpu", "tpu"), ("triton", "cuda")])
def test_kernel_lowers(backend, platform):
    """SmolLM2 decode shapes (9 q heads, 3 kv heads, D=64, 16-token blocks)."""
    shapes = [((2, 9, 64), jnp.float32), ((3, 32, 16, 64), jnp.float32),
              ((3, 32, 16, 64), jnp.float32), ((2, 8), jnp.int32), ((2,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    fn = functools.partial(api.paged_decode_attention, implementation="pallas",
                           backend=backend, interpret=False)
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    assert "paged_decode_attention" in lowered.as_text()


def test_paged_cache_with_pallas_decode_generates_like_xla(tiny):
    prompts = [[5, 9, 11, 3, 7], [2, 4, 8]]
    outs = []
    for impl in ("xla", "pallas"):
        t = paged_kv_cache(block_size=4, implementation=impl, interpret=True)
        model = calibrate_and_apply(t, tiny, None)[0]
        outs.append(generate(model, prompts, max_new_tokens=6).tokens)
    assert outs[0] == outs[1]


def test_bad_inputs():
    q, k, v, table, lengths = _inputs(seed=1)
    with pytest.raises(ValueError, match="q must be"):
        api.paged_decode_attention(q[0], k, v, table, lengths)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        api.paged_decode_attention(q[:, :5], k, v, table, lengths)
    with pytest.raises(ValueError, match="lengths must be"):
        api.paged_decode_attention(q, k, v, table, lengths[:2])
    with pytest.raises(TypeError, match="integers"):
        api.paged_decode_attention(q, k, v, table.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match="implementation"):
        api.paged_decode_attention(q, k, v, table, lengths, implementation="cuda")
    with pytest.raises(ValueError, match="backend"):
        api.paged_decode_attention(q, k, v, table, lengths, implementation="pallas",
                                   backend="rocm")
    with pytest.raises(ValueError, match="window"):
        api.paged_decode_attention(q, k, v, table, lengths, window=0)
