"""Paged VQ decode kernels (code pages read through the block table, no row gather):
interpret mode vs the XLA paged reference on fresh random inputs, both bodies, post- and
pre-RoPE codes; lowering for TPU and CUDA; the "auto" dispatch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.dispatch import custom_call_targets, has_pallas_call
from kernels_pallas.paged_attention import BlockSizes
from kernels_pallas.vq_attention import KeyRope, vq_decode_attention_paged_codes


def _paged_inputs(seed, b=3, hkv=2, gq=3, g=4, gs=4, page=16, m=5, n=19, n_codes=16,
                  shared=False, pre_rope=False):
    rng = np.random.default_rng(seed)
    d, hc = g * gs, 1 if shared else hkv
    table = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)
    lengths = np.asarray([m * page - 5, m * page, 2 * page + 3][:b], np.int32)  # ragged
    table[2, m - 1] = -1  # unmapped past row 2's length
    table[1, 1] = -1  # unmapped inside row 1's length: masked, as the reference does
    args = (jnp.asarray(rng.normal(size=(b, hkv * gq, d)), jnp.float32),
            jnp.asarray(rng.integers(0, n_codes, (n, page, hkv, g)), jnp.uint8),
            jnp.asarray(rng.integers(0, n_codes, (n, page, hkv, g)), jnp.uint8),
            jnp.asarray(rng.normal(size=(hc, g, n_codes, gs)), jnp.float32),
            jnp.asarray(rng.normal(size=(hc, g, n_codes, gs)), jnp.float32),
            jnp.asarray(table), jnp.asarray(lengths))
    rope = None
    if pre_rope:
        perm = np.stack([rng.permutation(d) for _ in range(hkv)])
        rope = KeyRope.from_permutation(perm, 10000.0)
    return args, rope


# (shared codebook, pre-RoPE, blocks): pages per step x per split, ragged last split
CASES = [(False, False, BlockSizes(2, 3)), (True, False, BlockSizes(1, 64)),
         (False, True, BlockSizes(2, 3)), (True, True, BlockSizes(3, 3))]


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("shared,pre_rope,blocks", CASES, ids=str)
def test_kernel_matches_paged_reference(backend, shared, pre_rope, blocks):
    args, rope = _paged_inputs(seed=len(str((backend, shared, pre_rope))), shared=shared,
                               pre_rope=pre_rope)
    want = vq_decode_attention_paged_codes(*args, key_rope=rope, implementation="xla")
    got = vq_decode_attention_paged_codes(*args, key_rope=rope, implementation="pallas",
                                          backend=backend, interpret=True, block_sizes=blocks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_kernel_empty_row_and_mqa(backend):
    """A row of length 0 attends to nothing (zeros, not NaN); one KV head (MQA)."""
    args, _ = _paged_inputs(seed=9, hkv=1, gq=4)
    args = args[:-1] + (args[-1].at[0].set(0),)
    want = vq_decode_attention_paged_codes(*args, implementation="xla")
    got = vq_decode_attention_paged_codes(*args, implementation="pallas", backend=backend,
                                          interpret=True, block_sizes=BlockSizes(2, 2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(got[0]))


def _lowered_targets(platform, pre_rope=False, **kw):
    """SmolLM2 TaSQ 1-bit layer shapes: 9 q heads, 3 KV heads, 8 groups x 8 channels,
    256 centroids, 16-token pages."""
    b, hkv, g, gs, n, m = 2, 3, 8, 8, 40, 20
    args = [jax.ShapeDtypeStruct((b, 9, g * gs), jnp.float32),
            jax.ShapeDtypeStruct((n, 16, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((n, 16, hkv, g), jnp.uint8),
            jax.ShapeDtypeStruct((1, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((1, g, 256, gs), jnp.float32),
            jax.ShapeDtypeStruct((b, m), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)]
    rope = None
    if pre_rope:
        perm = np.stack([np.random.default_rng(h).permutation(g * gs) for h in range(hkv)])
        rope = KeyRope.from_permutation(perm, 10000.0)

    def fn(*a):
        return vq_decode_attention_paged_codes(*a, key_rope=rope, **kw)
    return custom_call_targets(jax.jit(fn).trace(*args).lower(
        lowering_platforms=(platform,)).as_text())


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("pre_rope", [False, True])
def test_default_lowers_to_the_platform_paged_kernel(platform, pre_rope):
    assert has_pallas_call(_lowered_targets(platform, pre_rope), platform)


def test_default_on_cpu_is_xla():
    assert not _lowered_targets("cpu")


def test_untileable_pages_fall_back_to_xla_on_cuda_only():
    """8-token pages: Triton dot tiles need >= 16 rows; TPU still runs its kernel."""
    args, _ = _paged_inputs(seed=3, page=8)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]

    def targets(platform):
        return custom_call_targets(jax.jit(vq_decode_attention_paged_codes).trace(
            *shapes).lower(lowering_platforms=(platform,)).as_text())
    assert not has_pallas_call(targets("cuda"), "cuda")
    assert has_pallas_call(targets("tpu"), "tpu")
    with pytest.raises(ValueError, match="power-of-two block_size"):
        jax.jit(lambda *a: vq_decode_attention_paged_codes(
            *a, implementation="pallas", backend="triton")).trace(*shapes).lower(
                lowering_platforms=("cuda",))
