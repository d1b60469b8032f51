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

from kernels_pallas import dispatch
from kernels_pallas.grouped_matmul import kernel, reference, tiled

# "auto": the reference (ragged_dot) on CPU, the Mosaic kernel on TPU, the Triton kernel
# on CUDA, chosen at lowering (kernels_pallas.dispatch); "xla_tiled": the kernels' visit
# schedule in plain JAX (cost proportional to the rows on CPU).
IMPLEMENTATIONS = ("auto", "xla", "xla_tiled", "pallas")
PLATFORM_BACKENDS = {"tpu": "mosaic_tpu", "cuda": "triton"}


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """How to run a grouped matmul (hashable: a static argument under jit)."""

    implementation: str = "auto"
    # pallas only: None = the platform's kernel (PLATFORM_BACKENDS), or force one of
    # kernel.BACKENDS ("mosaic_tpu" | "triton"), e.g. to interpret it on CPU
    backend: str | None = None
    interpret: bool = False  # pallas kernels: run in the Pallas interpreter
    block_sizes: kernel.BlockSizes = kernel.BlockSizes()

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")
        if self.backend is not None and self.backend not in kernel.BACKENDS:
            raise ValueError(f"backend must be None or one of {kernel.BACKENDS}, "
                             f"got {self.backend!r}")
        if self.backend is not None and self.implementation != "pallas":
            raise ValueError(f"backend={self.backend!r} applies to implementation='pallas' "
                             f"only, got implementation={self.implementation!r}")


def _by_platform(cfg: GmmConfig, xla, pallas):
    """Run `xla()` or `pallas(backend)` per cfg and the lowering platform."""
    if cfg.implementation == "pallas" and cfg.backend is not None:
        return pallas(cfg.backend)
    branch = lambda backend: lambda: pallas(backend)  # noqa: E731
    return dispatch.dispatch(implementation=cfg.implementation, xla=xla,
                             tpu=branch(PLATFORM_BACKENDS["tpu"]),
                             cuda=branch(PLATFORM_BACKENDS["cuda"]))


def gmm_forward(lhs, rhs, group_sizes, cfg: GmmConfig, transpose_rhs: bool = False):
    """The forward grouped matmul of one implementation (no custom gradient)."""
    if cfg.implementation == "xla_tiled":
        return tiled.gmm_tiled(lhs, rhs, group_sizes, bm=cfg.block_sizes.bm,
                               transpose_rhs=transpose_rhs)
    return _by_platform(
        cfg, lambda: reference.gmm_reference(lhs, rhs, group_sizes, transpose_rhs),
        lambda backend: kernel.gmm(lhs, rhs, group_sizes, block_sizes=cfg.block_sizes,
                                   backend=backend, interpret=cfg.interpret,
                                   transpose_rhs=transpose_rhs))


def tgmm_forward(lhs, dout, group_sizes, cfg: GmmConfig):
    """Per-group lhs.T @ dout of one implementation."""
    if cfg.implementation == "xla_tiled":
        return tiled.tgmm_tiled(lhs, dout, group_sizes, bm=cfg.block_sizes.bm)
    return _by_platform(
        cfg, lambda: reference.tgmm_reference(lhs, dout, group_sizes),
        lambda backend: kernel.tgmm(lhs, dout, group_sizes, block_sizes=cfg.block_sizes,
                                    backend=backend, interpret=cfg.interpret))


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
