r"""Benchmark the Pallas paged decode-attention kernel against XLA on a GPU.

    python scripts/bench_paged_attention_gpu.py [--shapes smollm2_layer,llama31_8b_layer]
        [--batches 1,8,32] [--contexts 4096,32768] [--page 16] [--out paged.json]
    python scripts/bench_paged_attention_gpu.py --dry-run   # CPU: tiny sizes, bookkeeping

Needs a CUDA device unless --dry-run. For each named layer shape, batch and context, in one
process, after warm-up, medians of `--repeats` runs over bf16 K/V:
  bf16:      dense attention over the same tokens stored contiguously [B, S, Hkv, D] (XLA);
  kernel:    kernels_pallas.paged_attention, implementation="pallas" (the platform's
             kernel: Triton on CUDA) over token-major pages [N, page, Hkv, D] in a shuffled
             block table;
  xla_paged: the plain-JAX reference (gathers the pages, then attends);
  jax_paged: JAX's own Pallas GPU paged attention (jax.experimental.pallas.ops.gpu.
             paged_attention) over the same pages in its head-major layout [Hkv, N, page,
             D] (transposed once, outside the timing), query pre-scaled.
Each kernel is checked against the reference first. Reported: times, bf16_ms / kernel_ms
(> 1: faster than dense XLA attention) and each path's fraction of the H200 HBM roofline
(K/V bytes of the attended tokens / 4.8 TB/s over its time). --dry-run: CPU, tiny sizes,
"auto" (= XLA on CPU) in place of the kernel, JAX's kernel interpreted.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling VQ bench

import bench_vq_attention_gpu as vq_bench  # noqa: E402
from research.core.timing import time_fn  # noqa: E402
from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu_paged  # noqa: E402

from kernels_pallas.paged_attention import paged_decode_attention  # noqa: E402

SHAPES, BATCHES, CONTEXTS = vq_bench.SHAPES, vq_bench.BATCHES, vq_bench.CONTEXTS
PAGE = 16
DRY = dict(batches=(2,), contexts=(40,))  # 40 tokens: a partly filled last page


def paged_inputs(rng, shape: str, batch: int, context: int, page: int = PAGE) -> dict:
    """Fresh bf16 pages of one layer in a shuffled pool, each row `context` tokens long
    (the last page partly filled when page does not divide it)."""
    hq, hkv, d = SHAPES[shape]
    m = -(-context // page)
    pool = lambda: jnp.asarray(rng.normal(size=(batch * m, page, hkv, d)), jnp.bfloat16)  # noqa
    return dict(q=jnp.asarray(rng.normal(size=(batch, hq, d)), jnp.bfloat16), k_pool=pool(),
                v_pool=pool(),
                block_table=jnp.asarray(rng.permutation(batch * m).reshape(batch, m),
                                        jnp.int32),
                lengths=jnp.full((batch,), context, jnp.int32))


def bench_case(shape: str, batch: int, context: int, *, warmup: int, repeats: int,
               dry_run: bool, page: int = PAGE, seed: int = 0) -> dict:
    x = paged_inputs(np.random.default_rng(seed), shape, batch, context, page)
    args = tuple(x.values())
    table = np.asarray(x["block_table"])
    dense = lambda pool: pool[table].reshape((batch, -1) + pool.shape[2:])[:, :context]  # noqa
    kd, vd = dense(x["k_pool"]), dense(x["v_pool"])
    impl = "auto" if dry_run else "pallas"
    fns = {"bf16": (jax.jit(vq_bench.dense_attention), (x["q"], kd, vd, x["lengths"])),
           "kernel": (jax.jit(lambda *a: paged_decode_attention(*a, implementation=impl)),
                      args),
           "xla_paged": (jax.jit(lambda *a: paged_decode_attention(*a, implementation="xla")),
                         args)}
    m = x["block_table"].shape[1]
    per_block = min(8, m)
    jax_kw = dict(pages_per_compute_block=per_block, k_splits=max(1, min(16, m // per_block)),
                  interpret=dry_run)
    head_major = lambda pool: jnp.transpose(pool, (2, 0, 1, 3))  # noqa: E731
    scale = x["q"].shape[-1] ** -0.5
    fns["jax_paged"] = (jax.jit(lambda q, k, v, t, n: jax_gpu_paged.paged_attention(
        q * jnp.asarray(scale, q.dtype), k, v, t, n, **jax_kw)),
                        (x["q"], head_major(x["k_pool"]), head_major(x["v_pool"]),
                         x["block_table"], x["lengths"]))
    got = np.asarray(fns["kernel"][0](*args), np.float32)
    want = np.asarray(fns["xla_paged"][0](*args), np.float32)
    kv_bytes = vq_bench.nbytes(kd, vd, x["q"])  # the attended tokens, as read by any path
    row = {"shape": shape, "batch": batch, "context": context, "page": page,
           "max_abs_err": float(np.max(np.abs(got - want))),
           "bytes": {"bf16": kv_bytes, "kernel": kv_bytes, "xla_paged": kv_bytes,
                     "jax_paged": kv_bytes},
           "pool_bytes": vq_bench.nbytes(x["k_pool"], x["v_pool"])}
    for name, (fn, a) in fns.items():
        ms = time_fn(lambda fn=fn, a=a: fn(*a), warmup=warmup, repeats=repeats)["median_s"] * 1e3
        row[f"{name}_ms"] = ms
        row[f"{name}_hbm_roofline_frac"] = vq_bench.roofline_fraction(row["bytes"][name], ms)
    row["jax_paged_max_abs_err"] = float(np.max(np.abs(
        np.asarray(fns["jax_paged"][0](*fns["jax_paged"][1]), np.float32) - want)))
    row["bf16_over_kernel"] = row["bf16_ms"] / row["kernel_ms"]
    row["jax_paged_over_kernel"] = row["jax_paged_ms"] / row["kernel_ms"]
    return row


def run(shapes=tuple(SHAPES), batches=BATCHES, contexts=CONTEXTS, *, warmup: int = 3,
        repeats: int = 20, dry_run: bool = False, page: int = PAGE) -> list[dict]:
    if dry_run:
        batches, contexts, warmup, repeats = DRY["batches"], DRY["contexts"], 0, 1
    return [bench_case(s, b, c, warmup=warmup, repeats=repeats, dry_run=dry_run, page=page)
            for s in shapes for b in batches for c in contexts]


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page", type=int, default=PAGE)
    args, rest = ap.parse_known_args(argv)
    common = vq_bench.parse_args(rest)
    if not common.dry_run and jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU (or --dry-run); jax backend is "
                         f"{jax.default_backend()!r}")
    rows = run(tuple(common.shapes.split(",")), tuple(map(int, common.batches.split(","))),
               tuple(map(int, common.contexts.split(","))), warmup=common.warmup,
               repeats=common.repeats, dry_run=common.dry_run, page=args.page)
    vq_bench.report(rows, common.out, common.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
