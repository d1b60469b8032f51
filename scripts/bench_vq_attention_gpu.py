r"""Benchmark the Pallas VQ decode-attention kernel against the bf16 attention path on a GPU.

    python scripts/bench_vq_attention_gpu.py [--contexts 4096,16384,32768] [--batches 1,8,32]

Needs a CUDA device (jaxlib with CUDA). For each (batch, context), in one process, after
warm-up, medians of `--repeats` runs:
  bf16:   the core masked GQA attention over dense bf16 K/V (XLA), SmolLM2 layer shapes;
  pallas: kernels_pallas.vq_attention with the Triton backend over 1-bit uint8 codes;
  pallas-fast: the same with precision="default" (TF32 tensor-core dots);
  xla-vq: the plain-JAX reference (LUT gathers + segment sums) on the same codes;
  pallas-pre: the kernel over pre-RoPE codes (TaSQ key_space="pre_rope": keys rebuilt per
          block, rotated at their positions through the query terms).
It first checks the kernel against the reference on the device. Prints a markdown table and
writes --out (JSON) if given.

The expectation written before any GPU run (one-hot matmuls, ~32x the FLOPs of dense
attention, compute-bound) met a kernel that did not compile there at all (shared memory);
the Triton body now dequantizes blocks in registers instead. Measured on an H200:
docs/gpu_h200_2026-11-30.md (`scripts/gpu_check.py` runs this bench among its sections).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from research.core.timing import time_fn
from kernels_pallas.vq_attention import BlockSizes, KeyRope, vq_decode_attention
from research.core.attention import attend

HQ, HKV, D, G, K = 9, 3, 64, 8, 256  # SmolLM2-135M layer, 1 bit per channel


def _median_ms(fn, warmup: int, repeats: int) -> float:
    return time_fn(fn, warmup=warmup, repeats=repeats)["median_s"] * 1e3


def _dense(q, k, v, lengths):
    b, s = k.shape[:2]
    kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    return attend(q[:, None], k, v, (lengths - 1)[:, None], kv_pos,
                  kv_pos < lengths[:, None])[:, 0]


def coded_inputs(rng, batch: int, context: int) -> tuple:
    """(q, k_codes, v_codes, k_codebook, v_codebook, lengths) of one SmolLM2 layer at 1 bit
    per channel, every row `context` tokens long."""
    q = jnp.asarray(rng.normal(size=(batch, HQ, D)), jnp.float32)
    kc, vc = (jnp.asarray(rng.integers(0, K, (batch, HKV, G, context)), jnp.uint8)
              for _ in range(2))
    kcb, vcb = (jnp.asarray(rng.normal(size=(HKV, G, K, D // G)), jnp.float32)
                for _ in range(2))
    return q, kc, vc, kcb, vcb, jnp.full((batch,), context, jnp.int32)


def bench(batch: int, context: int, block_sizes: BlockSizes, warmup: int, repeats: int,
          seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    q, kc, vc, kcb, vcb, lengths = coded_inputs(rng, batch, context)
    k = jnp.asarray(rng.normal(size=(batch, context, HKV, D)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(batch, context, HKV, D)), jnp.bfloat16)
    dense = jax.jit(_dense)
    pallas = jax.jit(lambda q, kc, vc, n: vq_decode_attention(
        q, kc, vc, kcb, vcb, n, implementation="pallas", backend="triton",
        block_sizes=block_sizes))
    fast_blocks = dataclasses.replace(block_sizes, precision="default")
    pallas_fast = jax.jit(lambda q, kc, vc, n: vq_decode_attention(
        q, kc, vc, kcb, vcb, n, implementation="pallas", backend="triton",
        block_sizes=fast_blocks))
    xla = jax.jit(lambda q, kc, vc, n: vq_decode_attention(q, kc, vc, kcb, vcb, n))
    rope = KeyRope.from_permutation(np.stack([rng.permutation(D) for _ in range(HKV)]),
                                    10000.0)
    pre = {impl: jax.jit(lambda q, kc, vc, n, impl=impl: vq_decode_attention(
        q, kc, vc, kcb, vcb, n, implementation=impl, backend="triton",
        block_sizes=block_sizes, key_rope=rope)) for impl in ("pallas", "xla")}
    want = xla(q, kc, vc, lengths)
    err = float(jnp.max(jnp.abs(pallas(q, kc, vc, lengths) - want)))
    err_fast = float(jnp.max(jnp.abs(pallas_fast(q, kc, vc, lengths) - want)))
    err_pre = float(jnp.max(jnp.abs(pre["pallas"](q, kc, vc, lengths)
                                    - pre["xla"](q, kc, vc, lengths))))
    row = {"batch": batch, "context": context, "max_abs_err": err, "pre_max_abs_err": err_pre,
           "fast_max_abs_err": err_fast,
           "bf16_ms": _median_ms(lambda: dense(q, k, v, lengths), warmup, repeats),
           "pallas_ms": _median_ms(lambda: pallas(q, kc, vc, lengths), warmup, repeats),
           "pallas_fast_ms": _median_ms(lambda: pallas_fast(q, kc, vc, lengths), warmup,
                                        repeats),
           "xla_vq_ms": _median_ms(lambda: xla(q, kc, vc, lengths), warmup, repeats),
           "pallas_pre_ms": _median_ms(lambda: pre["pallas"](q, kc, vc, lengths), warmup,
                                       repeats),
           "bf16_bytes": int(k.nbytes + v.nbytes), "code_bytes": int(kc.nbytes + vc.nbytes)}
    row["pallas_speedup"] = row["bf16_ms"] / row["pallas_ms"]
    row["pallas_fast_speedup"] = row["bf16_ms"] / row["pallas_fast_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--block-kv", type=int, default=64,
                    help="one-hot tiles are [256, block_kv] f32: keep them small on GPU")
    ap.add_argument("--blocks-per-split", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU; jax backend is {jax.default_backend()!r}")
    bs = BlockSizes(block_kv=args.block_kv, blocks_per_split=args.blocks_per_split)
    rows = [bench(b, s, bs, args.warmup, args.repeats)
            for b in map(int, args.batches.split(",")) for s in map(int, args.contexts.split(","))]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
