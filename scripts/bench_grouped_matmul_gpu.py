r"""GPU benchmark: Pallas (Triton) grouped matmul vs XLA's jax.lax.ragged_dot, same process.

    python scripts/bench_grouped_matmul_gpu.py [--dtype bfloat16] [--repeats 20]

Needs a CUDA GPU (exits with a message otherwise). For each named shape it checks the
kernel against the reference on fresh random inputs, then times forward (gmm), the input
gradient (gmm with rhs^T) and the weight gradient (tgmm) after warm-up, reporting medians
and ratios (reference / kernel, > 1 means the kernel is faster). Not run in CI; no GPU was
available when it was written, so no numbers are claimed from it.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import time_fn
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
    kernel = functools.partial(grouped_matmul, implementation="pallas", backend="triton",
                               block_sizes=blocks)
    tkernel = functools.partial(transposed_grouped_matmul, implementation="pallas",
                                backend="triton", block_sizes=blocks)
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}, dtype {dtype.name}, blocks {blocks}")
    print("| shape | op | ragged_dot ms | pallas ms | speedup | max rel err |")
    print("|---|---|---|---|---|---|")
    for name, (m, k, n, g, zipf) in SHAPES.items():
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
        for op, (ref_fn, pallas_fn, op_args) in ops.items():
            want = ref_fn(*op_args).astype(jnp.float32)
            got = pallas_fn(*op_args).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-12))
            t_ref = median_seconds(lambda: ref_fn(*op_args), args.repeats)
            t_pal = median_seconds(lambda: pallas_fn(*op_args), args.repeats)
            print(f"| {name} | {op} | {t_ref * 1e3:.3f} | {t_pal * 1e3:.3f} | "
                  f"{t_ref / t_pal:.2f}x | {err:.1e} |")


if __name__ == "__main__":
    main()
