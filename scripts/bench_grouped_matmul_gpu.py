r"""GPU benchmark: Pallas (Triton) grouped matmul vs XLA's jax.lax.ragged_dot, same process.

    python scripts/bench_grouped_matmul_gpu.py [--dtype bfloat16] [--repeats 20]

Needs a CUDA GPU (exits with a message otherwise). For each named shape it checks the
kernel against the reference on fresh random inputs, then times forward (gmm), the input
gradient (gmm with rhs^T) and the weight gradient (tgmm) after warm-up, reporting medians
and ratios (reference / kernel, > 1 means the kernel is faster). Not run in CI. Measured on
an H200 (through scripts/gpu_check.py): docs/gpu_h200_2026-11-30.md.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from research.core.timing import time_fn
from kernels_pallas.grouped_matmul import (BlockSizes, grouped_matmul, gmm_reference,
                                           tgmm_reference, transposed_grouped_matmul)

# name: (rows M, K, N, groups G, Zipf exponent of the group sizes)
SHAPES = {
    "deepseek_v3_up_skewed": (32768, 7168, 2048, 32, 1.2),  # 4k tokens x top-8 on 1 GPU
    "deepseek_v3_down_skewed": (32768, 2048, 7168, 32, 1.2),
    "olmoe_up_uniform": (16384, 2048, 1024, 8, 0.0),
    "olmoe_up_one_hot_expert": (16384, 2048, 1024, 8, 3.0),
}


def group_sizes(m: int, g: int, zipf: float, rng) -> np.ndarray:
    p = np.arange(1, g + 1, dtype=np.float64) ** -zipf
    return rng.multinomial(m, p / p.sum()).astype(np.int32)


def median_seconds(fn, repeats: int) -> float:
    return time_fn(fn, warmup=2, repeats=repeats)["median_s"]


def bench_shape(name: str, dims: tuple, dtype, blocks: BlockSizes, repeats: int,
                rng) -> list[dict]:
    """Check then time gmm, gmm with rhs^T (the input gradient) and tgmm on one shape."""
    m, k, n, g, zipf = dims
    kernel = functools.partial(grouped_matmul, implementation="pallas", backend="triton",
                               block_sizes=blocks)
    tkernel = functools.partial(transposed_grouped_matmul, implementation="pallas",
                                backend="triton", block_sizes=blocks)
    gs = jnp.asarray(group_sizes(m, g, zipf, rng))
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
    dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
    ops = {
        "gmm": (jax.jit(lambda a, b, s: gmm_reference(a, b, s)), jax.jit(kernel),
                (lhs, rhs, gs)),
        # the input gradient: dout [M, N] x rhs [G, K, N]^T -> [M, K]
        "gmm rhs^T": (jax.jit(lambda a, b, s: gmm_reference(a, b, s, transpose_rhs=True)),
                      jax.jit(functools.partial(kernel, transpose_rhs=True)),
                      (dout, rhs, gs)),
        "tgmm": (jax.jit(tgmm_reference), jax.jit(tkernel), (lhs, dout, gs)),
    }
    rows = []
    for op, (ref_fn, pallas_fn, op_args) in ops.items():
        want = ref_fn(*op_args).astype(jnp.float32)
        got = pallas_fn(*op_args).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-12))
        t_ref = median_seconds(lambda: ref_fn(*op_args), repeats)
        t_pal = median_seconds(lambda: pallas_fn(*op_args), repeats)
        flops = 2 * int(gs.sum()) * k * n
        rows.append({"shape": name, "op": op, "ragged_dot_ms": t_ref * 1e3,
                     "pallas_ms": t_pal * 1e3, "speedup": t_ref / t_pal,
                     "pallas_tflops": flops / t_pal / 1e12, "max_rel_err": err})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--bm", type=int, default=128)
    parser.add_argument("--bk", type=int, default=64)
    parser.add_argument("--bn", type=int, default=128)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU; jax backend is {jax.default_backend()!r}")
    dtype = jnp.dtype(args.dtype)
    blocks = BlockSizes(args.bm, args.bk, args.bn)
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}, dtype {dtype.name}, blocks {blocks}")
    print("| shape | op | ragged_dot ms | pallas ms | speedup | pallas TFLOP/s | max rel err |")
    print("|---|---|---|---|---|---|---|")
    for name, dims in SHAPES.items():
        for r in bench_shape(name, dims, dtype, blocks, args.repeats, rng):
            print(f"| {name} | {r['op']} | {r['ragged_dot_ms']:.3f} | {r['pallas_ms']:.3f} | "
                  f"{r['speedup']:.2f}x | {r['pallas_tflops']:.1f} | {r['max_rel_err']:.1e} |")


if __name__ == "__main__":
    main()
