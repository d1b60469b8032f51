"""JAX's own TPU grouped matmul (megablox, `jax.experimental.pallas.ops.tpu.megablox`) as
an oracle: servax's Mosaic TPU kernel and its tiled XLA form equal megablox's gmm and tgmm,
both interpreted on the CPU, on fresh ragged group sizes (empty groups, rows past the
groups).

Why megablox is the oracle and not servax's TPU implementation: servax's kernels (Mosaic,
Triton, the tiled XLA path) share one tile-visit schedule (metadata.py), so the CPU-tested
XLA form checks the same algorithm the GPU and TPU run; megablox needs the row count to
be a multiple of its row tile, has no GPU form, and its tgmm takes lhs transposed. Where
the two disagree, this test names the op and the sizes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import (BlockSizes, grouped_matmul,
                                           transposed_grouped_matmul)

megablox = pytest.importorskip("jax.experimental.pallas.ops.tpu.megablox.gmm")

TILE = 16


def _inputs(seed, m=96, k=64, n=48, g=5):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(int(rng.integers(m // 2, m + 1)), np.ones(g) / g)
    sizes[rng.integers(g)] = 0  # an empty group; rows past sum(sizes) belong to none
    return (jnp.asarray(rng.normal(size=(m, k)), jnp.float32),
            jnp.asarray(rng.normal(size=(g, k, n)), jnp.float32),
            jnp.asarray(rng.normal(size=(m, n)), jnp.float32),
            jnp.asarray(sizes, jnp.int32))


def _rows_in_groups(x, sizes):
    return x[:int(np.sum(np.asarray(sizes)))]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("implementation", ["pallas", "xla_tiled"])
def test_gmm_and_tgmm_equal_megablox(seed, implementation):
    lhs, rhs, dout, sizes = _inputs(seed)
    kw = dict(implementation=implementation, block_sizes=BlockSizes(TILE, TILE, TILE))
    if implementation == "pallas":
        kw.update(backend="mosaic_tpu", interpret=True)
    tiling = (TILE, TILE, TILE)
    want = megablox.gmm(lhs, rhs, sizes, tiling=tiling, interpret=True)
    got = grouped_matmul(lhs, rhs, sizes, **kw)
    np.testing.assert_allclose(_rows_in_groups(got, sizes), _rows_in_groups(want, sizes),
                               rtol=1e-4, atol=1e-4, err_msg=f"gmm {sizes}")
    rhs_t = jnp.swapaxes(rhs, 1, 2)  # [G, N, K]
    want_t = megablox.gmm(lhs, rhs_t, sizes, tiling=tiling, transpose_rhs=True,
                          interpret=True)
    got_t = grouped_matmul(lhs, rhs_t, sizes, transpose_rhs=True, **kw)
    np.testing.assert_allclose(_rows_in_groups(got_t, sizes),
                               _rows_in_groups(want_t, sizes), rtol=1e-4, atol=1e-4,
                               err_msg=f"gmm rhs^T {sizes}")
    want_w = megablox.tgmm(lhs.T, dout, sizes, tiling=tiling, interpret=True)
    got_w = transposed_grouped_matmul(lhs, dout, sizes, **kw)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-4, atol=1e-4, err_msg=f"tgmm {sizes}")
