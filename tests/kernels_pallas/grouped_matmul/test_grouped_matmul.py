"""Grouped matmul: metadata, tiled and Pallas (interpret) implementations vs ragged_dot,
forward and vjp, lowering for TPU (Mosaic) and CUDA (Triton), and input errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import (BlockSizes, GroupedMatmul, gmm_reference,
                                           grouped_matmul, metadata, reference,
                                           tgmm_reference, transposed_grouped_matmul)
from kernels_pallas.grouped_matmul import kernel as gk

SMALL = BlockSizes(16, 16, 16)


def _inputs(seed, m, k, n, group_sizes, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(group_sizes), k, n)), dtype)
    dout = jnp.asarray(rng.normal(size=(m, n)), dtype)
    return lhs, rhs, jnp.asarray(group_sizes, jnp.int32), dout


def _random_sizes(rng, m, g):
    sizes = rng.multinomial(rng.integers(0, m + 1), np.ones(g) / g)
    sizes[rng.integers(g)] = 0  # at least one empty group
    return sizes


@pytest.mark.parametrize("seed", range(5))
def test_visits_cover_every_row_once(seed):
    rng = np.random.default_rng(seed)
    m, g, bm = int(rng.integers(1, 300)), int(rng.integers(1, 9)), int(rng.choice([8, 32]))
    sizes = jnp.asarray(_random_sizes(rng, m, g))
    mp = -(-m // bm) * bm
    v = jax.tree.map(np.asarray, jax.jit(metadata.gmm_visits, static_argnums=(1, 2, 3))(
        sizes, m, mp, bm))
    covered = np.zeros(mp, int)
    for i in range(len(v.segment)):
        rows = v.tile[i] * bm + np.arange(bm)
        covered[rows] += (rows >= v.starts[v.segment[i]]) & (rows < v.ends[v.segment[i]]) \
            & (v.valid[i] > 0)
    assert (covered == 1).all()
    assert (np.diff(v.tile) >= 0).all()  # visits of a tile are consecutive (TPU residency)
    t = jax.tree.map(np.asarray, jax.jit(metadata.tgmm_visits, static_argnums=(1, 2, 3))(
        sizes, m, mp, bm))
    assert set(t.segment[t.valid > 0]) == set(range(g))  # every group, even empty, visited


@jax.jit
def _tiled_and_references(lhs, rhs, gs, dout):
    tiled = grouped_matmul(lhs, rhs, gs, implementation="xla_tiled",
                           block_sizes=BlockSizes(bm=16))
    ttiled = transposed_grouped_matmul(lhs, dout, gs, implementation="xla_tiled",
                                       block_sizes=BlockSizes(bm=16))
    return (tiled, gmm_reference(lhs, rhs, gs), reference.gmm_masked(lhs, rhs, gs),
            ttiled, tgmm_reference(lhs, dout, gs), reference.tgmm_masked(lhs, dout, gs))


@pytest.mark.parametrize("seed", range(2))
def test_tiled_matches_reference(seed):
    rng = np.random.default_rng(seed)
    m, k, n, g = int(rng.integers(1, 200)), int(rng.integers(1, 40)), int(rng.integers(1, 40)), \
        int(rng.integers(1, 7))
    lhs, rhs, gs, dout = _inputs(seed, m, k, n, _random_sizes(rng, m, g))
    tiled, ref, masked, ttiled, tref, tmasked = _tiled_and_references(lhs, rhs, gs, dout)
    for got, want in [(tiled, ref), (masked, ref), (ttiled, tref), (tmasked, tref)]:
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def _check_vjp(fn, lhs, rhs, gs, dout, atol):
    y, pull = jax.vjp(lambda a, b: fn(a, b, gs), lhs, rhs)
    y_ref, pull_ref = jax.vjp(lambda a, b: gmm_reference(a, b, gs), lhs, rhs)
    np.testing.assert_allclose(y, y_ref, atol=atol, rtol=atol)
    for got, want in zip(pull(dout), pull_ref(dout)):
        np.testing.assert_allclose(got, want, atol=atol, rtol=atol)


# Group sizes not multiples of the 16-row tile, an empty group, rows past the groups
# (tail), several k and n tiles (K=40, N=36 pad to 48).
CASES = [(61, 40, 36, [13, 0, 21, 19]), (37, 24, 20, [37, 0])]


@pytest.mark.parametrize("backend", gk.BACKENDS)
@pytest.mark.parametrize("case", [0, pytest.param(1, marks=pytest.mark.slow)])  # slow: ~8 s
def test_pallas_interpret_forward_and_vjp(backend, case):
    m, k, n, sizes = CASES[case]
    lhs, rhs, gs, dout = _inputs(10 + case, m, k, n, sizes)
    fn = functools.partial(grouped_matmul, implementation="pallas", backend=backend,
                           interpret=True, block_sizes=SMALL)
    _check_vjp(jax.jit(fn), lhs, rhs, gs, dout, atol=1e-4)  # the vjp runs tgmm too


@pytest.mark.parametrize("backend", gk.BACKENDS)
def test_pallas_interpret_transposed_rhs_and_bf16(backend):
    lhs, rhs, gs, _ = _inputs(3, 50, 32, 24, [7, 30, 0, 9], jnp.bfloat16)
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    got = jax.jit(functools.partial(
        grouped_matmul, implementation="pallas", backend=backend, interpret=True,
        block_sizes=SMALL, transpose_rhs=True))(lhs, rhs_t, gs)
    want = gmm_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=0.1, rtol=0.02)


def test_tiled_vjp_and_jit():
    lhs, rhs, gs, dout = _inputs(4, 70, 12, 10, [0, 33, 5, 20])
    fn = jax.jit(functools.partial(grouped_matmul, implementation="xla_tiled",
                                   block_sizes=BlockSizes(bm=8)))
    _check_vjp(fn, lhs, rhs, gs, dout, atol=1e-4)


@pytest.mark.parametrize("backend,platform", [("mosaic_tpu", "tpu"), ("triton", "cuda")])
def test_lowers_for_accelerators(backend, platform):
    m, k, n, g = 300, 256, 384, 5
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def loss(a, b, s):  # forward + both backward kernels (gmm with rhs^T, tgmm)
        out = grouped_matmul(a, b, s, implementation="pallas", backend=backend)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(lhs, rhs, gs).lower(
        lowering_platforms=(platform,)).as_text()
    marker = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    assert text.count(marker) >= 3, f"expected 3 {backend} kernels in the lowering"


def test_grouped_matmul_callable_in_expert_ffn():
    from research.model import layers
    lhs, rhs, gs, _ = _inputs(5, 40, 16, 24, [10, 20, 10])
    w_down = jnp.swapaxes(rhs, 1, 2)
    matmul = GroupedMatmul("xla_tiled", block_sizes=BlockSizes(bm=8))
    assert hash(matmul) == hash(GroupedMatmul("xla_tiled", block_sizes=BlockSizes(bm=8)))
    ffn = jax.jit(layers.expert_ffn, static_argnums=5)
    got = ffn(lhs, gs, rhs, rhs, w_down, matmul)
    want = ffn(lhs, gs, rhs, rhs, w_down, jax.lax.ragged_dot)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_bad_inputs():
    lhs, rhs, gs, dout = _inputs(6, 20, 8, 8, [10, 10])
    with pytest.raises(ValueError, match="exceeds"):
        grouped_matmul(lhs, rhs, jnp.array([15, 10], jnp.int32))
    with pytest.raises(ValueError, match=">= 0"):
        grouped_matmul(lhs, rhs, jnp.array([-1, 10], jnp.int32))
    with pytest.raises(ValueError, match="contraction"):
        grouped_matmul(lhs[:, :4], rhs, gs)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(lhs, rhs, jnp.array([20], jnp.int32))
    with pytest.raises(TypeError, match="integers"):
        grouped_matmul(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(TypeError, match="dtypes differ"):
        grouped_matmul(lhs, rhs.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="implementation"):
        grouped_matmul(lhs, rhs, gs, implementation="cuda")
    with pytest.raises(ValueError, match="backend"):
        grouped_matmul(lhs, rhs, gs, implementation="pallas", backend="mosaic_gpu")
    with pytest.raises(ValueError, match="powers of two"):
        grouped_matmul(lhs, rhs, gs, implementation="pallas", backend="triton",
                       block_sizes=BlockSizes(24, 16, 16), interpret=True)
    with pytest.raises(ValueError, match="multiples of 128"):
        gk.gmm(jnp.zeros((8, 300)), jnp.zeros((1, 300, 8)), jnp.array([8]),
               block_sizes=BlockSizes(8, 100, 8))
    with pytest.raises(ValueError, match="BlockSizes.bm"):
        BlockSizes(bm=0)


# -- the platform dispatch (implementation="auto", the default) -------------------------
def _default_grad_lowering(platform):
    m, k, n, g = 200, 128, 256, 4
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32))
    loss = lambda a, b, s: jnp.sum(grouped_matmul(a, b, s).astype(jnp.float32) ** 2)  # noqa
    return jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform,marker", [("tpu", "tpu_custom_call"),
                                             ("cuda", "__gpu$xla.gpu.triton")])
def test_default_lowers_to_the_platform_kernel(platform, marker):
    """forward gmm + backward gmm(rhs^T) and tgmm: three kernels, no ragged_dot left."""
    text = _default_grad_lowering(platform)
    assert text.count(marker) >= 3
    assert "ragged_dot" not in text


def test_default_on_cpu_is_xla_and_equals_reference():
    text = _default_grad_lowering("cpu")
    assert "custom_call @tpu_custom_call" not in text and "triton" not in text
    lhs, rhs, gs, dout = _inputs(21, 90, 24, 40, [0, 37, 5, 30, 11])  # 7 rows past groups
    _check_vjp(jax.jit(grouped_matmul), lhs, rhs, gs, dout, atol=1e-4)
    np.testing.assert_allclose(jax.jit(grouped_matmul)(lhs, rhs, gs),
                               gmm_reference(lhs, rhs, gs), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(transposed_grouped_matmul)(lhs, dout, gs),
                               tgmm_reference(lhs, dout, gs), atol=1e-4, rtol=1e-5)


def test_pallas_without_backend_picks_the_platform_kernel():
    m, k, n, g = 64, 128, 128, 2
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32),
            jax.ShapeDtypeStruct((g, k, n), jnp.float32), jax.ShapeDtypeStruct((g,), jnp.int32))
    fn = jax.jit(functools.partial(grouped_matmul, implementation="pallas"))
    assert "tpu_custom_call" in fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "triton" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    with pytest.raises(ValueError, match="applies to implementation='pallas'"):
        GroupedMatmul("auto", backend="triton")
