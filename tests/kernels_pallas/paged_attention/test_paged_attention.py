"""Paged decode attention over token-major pages [N, block_size, Hkv, D]: kernels
(interpret mode) vs the plain-JAX reference on fresh random inputs, the reference vs dense
attention, the platform dispatch, lowering for TPU (Mosaic) and CUDA (Triton)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.dispatch import custom_call_targets, has_pallas_call
from kernels_pallas.paged_attention import BlockSizes, api, paged_decode_attention_reference
from research.core.attention import attend


def _inputs(seed, b=3, hq=6, hkv=2, d=16, s=8, n=20, m=5, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(n, s, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(n, s, hkv, d)), dtype)
    table = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)
    lengths = np.asarray([m * s - 5, m * s, (m - 2) * s + 3][:b], np.int32)  # ragged
    table[2, m - 1] = -1  # unmapped past row 2's length
    table[1, 1] = -1  # unmapped inside row 1's length: masked, as in the reference
    return q, k, v, jnp.asarray(table), jnp.asarray(lengths)


def test_reference_equals_dense_attention_over_gathered_rows():
    q, k, v, table, lengths = _inputs(0)
    s = k.shape[1]
    rows = np.asarray(table)
    keys = np.concatenate([np.asarray(k)[np.maximum(rows, 0)][:, i] for i in
                           range(rows.shape[1])], axis=1)  # [B, M*S, Hkv, D]
    vals = np.concatenate([np.asarray(v)[np.maximum(rows, 0)][:, i] for i in
                           range(rows.shape[1])], axis=1)
    pos = np.broadcast_to(np.arange(keys.shape[1]), keys.shape[:2])
    valid = (pos < np.asarray(lengths)[:, None]) & np.repeat(rows >= 0, s, axis=1)
    want = attend(q[:, None], jnp.asarray(keys), jnp.asarray(vals), (lengths - 1)[:, None],
                  jnp.asarray(pos), jnp.asarray(valid))[:, 0]
    got = paged_decode_attention_reference(q, k, v, table, lengths)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# (pages per step, pages per split): one page a step; several pages a step and several
# splits with a ragged last split; one split covering the row
BLOCKS = [BlockSizes(1, 2), BlockSizes(2, 3), BlockSizes(3, 64)]


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("blocks", BLOCKS, ids=str)
def test_kernel_matches_reference(backend, window, blocks):
    args = _inputs(seed=len(str((backend, window, blocks))))
    want = api.paged_decode_attention(*args, window=window, implementation="xla")
    got = api.paged_decode_attention(*args, window=window, implementation="pallas",
                                     backend=backend, interpret=True, block_sizes=blocks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
def test_kernel_bf16_mqa_and_empty_row(backend):
    q, k, v, table, lengths = _inputs(seed=7, hq=4, hkv=1, dtype=jnp.bfloat16)
    lengths = lengths.at[0].set(0)  # attends to nothing -> zeros, not NaN
    want = api.paged_decode_attention(q, k, v, table, lengths, implementation="xla")
    got = api.paged_decode_attention(q, k, v, table, lengths, implementation="pallas",
                                     backend=backend, interpret=True,
                                     block_sizes=BlockSizes(2, 2))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=3e-2, atol=3e-2)
    assert not np.any(np.asarray(got[0], np.float32))


def _int8_pages(seed, **kw):
    """Int8Codec's pages of _inputs' K/V: codes and float16 scales [N, S, Hkv, 1]."""
    from research.kv.quantized import quantize_int8
    q, k, v, table, lengths = _inputs(seed, **kw)
    (k8, ks), (v8, vs) = quantize_int8(k), quantize_int8(v)
    return (q, k8, v8, table, lengths), dict(k_scale=ks, v_scale=vs)


def test_int8_reference_equals_float_reference_over_dequantized_pages():
    (q, k8, v8, table, lengths), scales = _int8_pages(3)
    k = k8.astype(jnp.float32) * scales["k_scale"].astype(jnp.float32)
    v = v8.astype(jnp.float32) * scales["v_scale"].astype(jnp.float32)
    np.testing.assert_allclose(
        api.paged_decode_attention(q, k8, v8, table, lengths, implementation="xla",
                                   **scales),
        paged_decode_attention_reference(q, k, v, table, lengths), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
@pytest.mark.parametrize("window,blocks", [(None, BlockSizes(2, 3)), (11, BlockSizes(1, 2))],
                         ids=str)
def test_int8_kernel_matches_reference(backend, window, blocks):
    """int8 pages + float16 scales, dequantized a page tile at a time in the kernel (its
    dots in bf16: bf16-level agreement with the f32 reference, not f32's)."""
    args, scales = _int8_pages(seed=len(str((backend, window))))
    want = api.paged_decode_attention(*args, window=window, implementation="xla", **scales)
    got = api.paged_decode_attention(*args, window=window, implementation="pallas",
                                     backend=backend, interpret=True, block_sizes=blocks,
                                     **scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
    assert got.dtype == args[0].dtype


def test_int8_pages_bad_inputs():
    (q, k8, v8, table, lengths), scales = _int8_pages(5)
    with pytest.raises(ValueError, match="given together"):
        api.paged_decode_attention(q, k8, v8, table, lengths, k_scale=scales["k_scale"])
    with pytest.raises(TypeError, match="must be int8"):
        api.paged_decode_attention(q, k8.astype(jnp.float32), v8.astype(jnp.float32), table,
                                   lengths, **scales)
    with pytest.raises(ValueError, match="k_scale must be float"):
        api.paged_decode_attention(q, k8, v8, table, lengths,
                                   k_scale=scales["k_scale"][..., 0],
                                   v_scale=scales["v_scale"])
    with pytest.raises(TypeError, match="one float dtype"):
        api.paged_decode_attention(q, k8, v8, table, lengths)


# SmolLM2 decode shapes (9 q heads, 3 kv heads, D=64, 16-token pages)
SMOL = [((2, 9, 64), jnp.bfloat16), ((40, 16, 3, 64), jnp.bfloat16),
        ((40, 16, 3, 64), jnp.bfloat16), ((2, 20), jnp.int32), ((2,), jnp.int32)]


def _targets(platform, shapes=SMOL, **kw):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    fn = functools.partial(api.paged_decode_attention, **kw)
    return custom_call_targets(jax.jit(fn).trace(*args).lower(
        lowering_platforms=(platform,)).as_text())


@pytest.mark.parametrize("backend,platform", [("mosaic_tpu", "tpu"), ("triton", "cuda")])
@pytest.mark.parametrize("window", [None, 100])
def test_kernel_lowers(backend, platform, window):
    targets = _targets(platform, implementation="pallas", backend=backend, window=window,
                       block_sizes=BlockSizes(4, 8))
    assert has_pallas_call(targets, platform), targets


INT8_SMOL = [((2, 9, 64), jnp.float32), ((40, 16, 3, 64), jnp.int8),
             ((40, 16, 3, 64), jnp.int8), ((2, 20), jnp.int32), ((2,), jnp.int32),
             ((40, 16, 3, 1), jnp.float16), ((40, 16, 3, 1), jnp.float16)]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_int8_pages_lower_to_the_platform_kernel(platform):
    def fn(q, k, v, table, lengths, ks, vs):
        return api.paged_decode_attention(q, k, v, table, lengths, k_scale=ks, v_scale=vs)
    args = [jax.ShapeDtypeStruct(s, d) for s, d in INT8_SMOL]
    targets = custom_call_targets(jax.jit(fn).trace(*args).lower(
        lowering_platforms=(platform,)).as_text())
    assert has_pallas_call(targets, platform), targets


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_default_lowers_to_the_platform_kernel(platform):
    assert has_pallas_call(_targets(platform), platform)


def test_default_on_cpu_is_xla_and_equals_reference():
    assert not has_pallas_call(_targets("cpu"), "cuda") and not _targets("cpu")
    args = _inputs(seed=11)
    np.testing.assert_allclose(api.paged_decode_attention(*args, window=9),
                               paged_decode_attention_reference(*args, window=9),
                               rtol=1e-6, atol=1e-6)


def test_default_on_cuda_falls_back_to_xla_for_untileable_shapes():
    """block_size 8 (< 16, Triton dot tiles): CUDA runs XLA, TPU still the kernel."""
    shapes = [((2, 4, 16), jnp.float32), ((9, 8, 2, 16), jnp.float32),
              ((9, 8, 2, 16), jnp.float32), ((2, 4), jnp.int32), ((2,), jnp.int32)]
    assert not has_pallas_call(_targets("cuda", shapes), "cuda")
    assert has_pallas_call(_targets("tpu", shapes), "tpu")
    with pytest.raises(ValueError, match="power-of-two block_size"):
        _targets("cuda", shapes, implementation="pallas", backend="triton")


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
    with pytest.raises(ValueError, match="n_blocks, block_size, kv_heads"):
        api.paged_decode_attention(q, k, v[:, :4], table, lengths)
    with pytest.raises(ValueError, match="implementation"):
        api.paged_decode_attention(q, k, v, table, lengths, implementation="cuda")
    with pytest.raises(ValueError, match="backend"):
        api.paged_decode_attention(q, k, v, table, lengths, implementation="pallas",
                                   backend="rocm")
    with pytest.raises(ValueError, match="applies to implementation='pallas'"):
        api.paged_decode_attention(q, k, v, table, lengths, backend="triton")
    with pytest.raises(ValueError, match="window"):
        api.paged_decode_attention(q, k, v, table, lengths, window=0)
    with pytest.raises(ValueError, match="pages_per_step"):
        BlockSizes(pages_per_step=0)
