"""Public entry points: grouped_matmul (differentiable) and transposed_grouped_matmul.

    y = grouped_matmul(x_sorted, w, group_sizes)   # auto: the platform's implementation

implementation: "auto" (default: jax.lax.ragged_dot on CPU, the Mosaic kernel on TPU, the
Triton kernel on CUDA, chosen when lowering: kernels_pallas.dispatch), "xla"
(jax.lax.ragged_dot, the reference), "xla_tiled" (the kernels' tile-visit algorithm in
plain JAX, cost proportional to the rows: the fast one on CPU), "pallas" (kernel.py: the
platform's kernel, or `backend` "mosaic_tpu" | "triton"; `interpret=True` on CPU).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels_pallas.grouped_matmul import ops
from kernels_pallas.grouped_matmul.kernel import BlockSizes
from kernels_pallas.grouped_matmul.ops import GmmConfig


def _check_group_sizes(group_sizes, n_groups: int, m: int) -> None:
    if group_sizes.ndim != 1 or group_sizes.shape[0] != n_groups:
        raise ValueError(f"group_sizes must be [G={n_groups}], got {group_sizes.shape=}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers, got {group_sizes.dtype=}")
    try:
        sizes = np.asarray(group_sizes)
    except jax.errors.TracerArrayConversionError:
        return  # values unknown under jit: rows past m belong to no group (as ragged_dot)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {sizes.tolist()}")
    if sizes.sum() > m:
        raise ValueError(f"sum(group_sizes)={int(sizes.sum())} exceeds the {m} lhs rows")


def _check_float(name: str, x, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got {x.shape=}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got {x.dtype=}")


def grouped_matmul(lhs: Float[Array, "M K"], rhs: Float[Array, "G K N"],
                   group_sizes: Int[Array, "G"], *, implementation: str = "auto",
                   backend: str | None = None, interpret: bool = False,
                   block_sizes: BlockSizes | None = None,
                   transpose_rhs: bool = False) -> Array:
    """out[m] = lhs[m] @ rhs[group(m)] for expert-sorted rows; rows past the groups are 0.

    rhs is [G, N, K] when transpose_rhs. Differentiable in lhs and rhs (custom_vjp:
    dlhs is a grouped matmul with the transposed rhs, drhs a transposed grouped matmul).
    """
    _check_float("lhs", lhs, 2)
    _check_float("rhs", rhs, 3)
    k_axis = 2 if transpose_rhs else 1
    if rhs.shape[k_axis] != lhs.shape[1]:
        raise ValueError(f"contraction mismatch: {lhs.shape=} vs {rhs.shape=} "
                         f"({transpose_rhs=})")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs dtypes differ: {lhs.dtype} vs {rhs.dtype}")
    _check_group_sizes(group_sizes, rhs.shape[0], lhs.shape[0])
    cfg = GmmConfig(implementation, backend, interpret, block_sizes or BlockSizes())
    if cfg.implementation == "xla":
        return ops.gmm_forward(lhs, rhs, group_sizes, cfg, transpose_rhs)
    return ops.gmm(lhs, rhs, group_sizes, cfg, transpose_rhs)


def transposed_grouped_matmul(lhs: Float[Array, "M K"], dout: Float[Array, "M N"],
                              group_sizes: Int[Array, "G"], *, implementation: str = "auto",
                              backend: str | None = None, interpret: bool = False,
                              block_sizes: BlockSizes | None = None) -> Array:
    """tgmm: out[g] = lhs[rows of g].T @ dout[rows of g], [G, K, N] (the weight gradient)."""
    _check_float("lhs", lhs, 2)
    _check_float("dout", dout, 2)
    if dout.shape[0] != lhs.shape[0]:
        raise ValueError(f"row mismatch: {lhs.shape=} vs {dout.shape=}")
    _check_group_sizes(group_sizes, group_sizes.shape[0] if group_sizes.ndim == 1 else -1,
                       lhs.shape[0])
    cfg = GmmConfig(implementation, backend, interpret, block_sizes or BlockSizes())
    return ops.tgmm_forward(lhs, dout, group_sizes, cfg)


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
    """A hashable grouped-matmul callable (lhs, rhs, group_sizes) -> out, e.g. for
    `research.model.layers.expert_ffn(matmul=...)` inside a static model config."""

    implementation: str = "auto"
    backend: str | None = None
    interpret: bool = False
    block_sizes: BlockSizes = BlockSizes()

    def __post_init__(self):
        GmmConfig(self.implementation, self.backend, self.interpret, self.block_sizes)

    def __call__(self, lhs, rhs, group_sizes):
        return grouped_matmul(lhs, rhs, group_sizes, implementation=self.implementation,
                              backend=self.backend, interpret=self.interpret,
                              block_sizes=self.block_sizes)
