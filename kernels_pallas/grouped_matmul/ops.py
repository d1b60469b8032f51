"""Differentiable grouped matmul: custom_vjp over the tiled and Pallas implementations.

    out   = gmm(lhs, rhs)                      [M, K] x [G, K, N] -> [M, N]
    dlhs  = gmm(dout, rhs, transpose_rhs)      [M, N] x [G, K, N]^T -> [M, K]
    drhs  = tgmm(lhs, dout)                    [M, K]^T x [M, N] per group -> [G, K, N]

With transpose_rhs (rhs is [G, N, K]) the roles swap: dlhs = gmm(dout, rhs) and
drhs = tgmm(dout, lhs). group_sizes is integer data and gets no cotangent.
"""
from __future__ import annotations

import dataclasses
import functools

import jax

from kernels_pallas.grouped_matmul import kernel, reference, tiled

IMPLEMENTATIONS = ("xla", "xla_tiled", "pallas")


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """How to run a grouped matmul (hashable: a static argument under jit)."""

    implementation: str = "xla"
    backend: str = "mosaic_tpu"  # pallas only: "mosaic_tpu" | "triton"
    interpret: bool = False  # pallas only: run in the Pallas interpreter
    block_sizes: kernel.BlockSizes = kernel.BlockSizes()

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")
        if self.backend not in kernel.BACKENDS:
            raise ValueError(f"backend must be one of {kernel.BACKENDS}, got {self.backend!r}")


def gmm_forward(lhs, rhs, group_sizes, cfg: GmmConfig, transpose_rhs: bool = False):
    """The forward grouped matmul of one implementation (no custom gradient)."""
    if cfg.implementation == "xla":
        return reference.gmm_reference(lhs, rhs, group_sizes, transpose_rhs)
    if cfg.implementation == "xla_tiled":
        return tiled.gmm_tiled(lhs, rhs, group_sizes, bm=cfg.block_sizes.bm,
                               transpose_rhs=transpose_rhs)
    return kernel.gmm(lhs, rhs, group_sizes, block_sizes=cfg.block_sizes, backend=cfg.backend,
                      interpret=cfg.interpret, transpose_rhs=transpose_rhs)


def tgmm_forward(lhs, dout, group_sizes, cfg: GmmConfig):
    """Per-group lhs.T @ dout of one implementation."""
    if cfg.implementation == "xla":
        return reference.tgmm_reference(lhs, dout, group_sizes)
    if cfg.implementation == "xla_tiled":
        return tiled.tgmm_tiled(lhs, dout, group_sizes, bm=cfg.block_sizes.bm)
    return kernel.tgmm(lhs, dout, group_sizes, block_sizes=cfg.block_sizes,
                       backend=cfg.backend, interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gmm(lhs, rhs, group_sizes, cfg: GmmConfig, transpose_rhs: bool = False):
    return gmm_forward(lhs, rhs, group_sizes, cfg, transpose_rhs)


def _gmm_fwd(lhs, rhs, group_sizes, cfg, transpose_rhs):
    return gmm_forward(lhs, rhs, group_sizes, cfg, transpose_rhs), (lhs, rhs, group_sizes)


def _gmm_bwd(cfg, transpose_rhs, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    dlhs = gmm_forward(dout, rhs, group_sizes, cfg, transpose_rhs=not transpose_rhs)
    if transpose_rhs:
        drhs = tgmm_forward(dout, lhs, group_sizes, cfg)
    else:
        drhs = tgmm_forward(lhs, dout, group_sizes, cfg)
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
