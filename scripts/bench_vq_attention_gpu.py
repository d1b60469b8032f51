r"""Benchmark the Pallas VQ decode-attention kernel against bf16 attention on a GPU.

    python scripts/bench_vq_attention_gpu.py [--shapes smollm2_layer,llama31_8b_layer]
        [--batches 1,8,32] [--contexts 4096,32768] [--out vq.json]
    python scripts/bench_vq_attention_gpu.py --dry-run   # CPU: tiny sizes, bookkeeping only

Needs a CUDA device (jaxlib with CUDA) unless --dry-run. For each named layer shape, batch
and context, in one process, after warm-up, medians of `--repeats` runs of
  bf16:    the core masked GQA attention over dense bf16 K/V (XLA);
  kernel:  kernels_pallas.vq_attention, implementation="pallas" (the platform's kernel:
           Triton on CUDA) over 1-bit uint8 codes (token-major [B, S, Hkv, G], groups of 8
           channels, 256 centroids);
  xla_vq:  the plain-JAX reference on the same codes (small cases only: it is slow).
Each kernel is checked against the reference on the device first (max_abs_err). Reported:
times, bf16_ms / kernel_ms (> 1: the kernel is faster) and each path's fraction of the H200
HBM roofline (bytes it must read / 4.8 TB/s over its time; bytes counted from the arrays).
--dry-run runs the same bookkeeping on the CPU with tiny contexts and the XLA paths only
(implementation "auto" is XLA there), so the script is tested without a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from research.core.timing import time_fn
from kernels_pallas.vq_attention import vq_decode_attention
from research.core.attention import attend

HBM_BYTES_PER_S = 4.8e12  # H200
# name: (query heads, KV heads, head dim); codes: 1 bit per channel = 8-channel groups
SHAPES = {"smollm2_layer": (9, 3, 64), "llama31_8b_layer": (32, 8, 128)}
GROUP, CENTROIDS = 8, 256
BATCHES, CONTEXTS = (1, 8, 32), (4096, 32768)
DRY = dict(batches=(2,), contexts=(40,))  # ragged rows, a length not a power of two


def dense_attention(q, k, v, lengths):
    """One decode query per row over dense K/V [B, S, Hkv, D] (the XLA baseline)."""
    b, s = k.shape[:2]
    kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    return attend(q[:, None], k, v, (lengths - 1)[:, None], kv_pos,
                  kv_pos < lengths[:, None])[:, 0]


def coded_inputs(rng, shape: str, batch: int, context: int) -> dict:
    """Fresh random codes and codebooks of one layer; rows of ragged lengths (the first
    full, the others uniform in [context/2, context])."""
    hq, hkv, d = SHAPES[shape]
    g = d // GROUP
    lengths = rng.integers(context // 2, context + 1, (batch,)).astype(np.int32)
    lengths[0] = context
    codes = lambda: jnp.asarray(rng.integers(0, CENTROIDS, (batch, context, hkv, g)),  # noqa
                                jnp.uint8)
    book = lambda: jnp.asarray(rng.normal(size=(hkv, g, CENTROIDS, GROUP)), jnp.float32)  # noqa
    return dict(q=jnp.asarray(rng.normal(size=(batch, hq, d)), jnp.bfloat16),
                k_codes=codes(), v_codes=codes(), k_codebook=book(), v_codebook=book(),
                lengths=jnp.asarray(lengths))


def nbytes(*arrays) -> int:
    return int(sum(a.nbytes for a in arrays))


def roofline_fraction(n_bytes: int, ms: float) -> float:
    return n_bytes / HBM_BYTES_PER_S / (ms * 1e-3)


def bench_case(shape: str, batch: int, context: int, *, warmup: int, repeats: int,
               dry_run: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = coded_inputs(rng, shape, batch, context)
    hq, hkv, d = SHAPES[shape]
    k = jnp.asarray(rng.normal(size=(batch, context, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(batch, context, hkv, d)), jnp.bfloat16)
    impl = "auto" if dry_run else "pallas"  # auto on CPU = XLA: bookkeeping only
    args = (x["q"], x["k_codes"], x["v_codes"], x["k_codebook"], x["v_codebook"],
            x["lengths"])
    fns = {"bf16": (jax.jit(dense_attention), (x["q"], k, v, x["lengths"])),
           "kernel": (jax.jit(lambda *a: vq_decode_attention(*a, implementation=impl)), args)}
    if dry_run or batch * context <= 8 * 32768:
        fns["xla_vq"] = (jax.jit(lambda *a: vq_decode_attention(*a, implementation="xla")),
                         args)
    got = np.asarray(fns["kernel"][0](*args), np.float32)
    want = np.asarray(vq_decode_attention(*args, implementation="xla"), np.float32)
    row = {"shape": shape, "batch": batch, "context": context,
           "max_abs_err": float(np.max(np.abs(got - want))),
           "bytes": {"bf16": nbytes(k, v, x["q"]),
                     "kernel": nbytes(*args), "xla_vq": nbytes(*args)}}
    for name, (fn, a) in fns.items():
        ms = time_fn(lambda fn=fn, a=a: fn(*a), warmup=warmup, repeats=repeats)["median_s"] * 1e3
        row[f"{name}_ms"] = ms
        row[f"{name}_hbm_roofline_frac"] = roofline_fraction(row["bytes"][name], ms)
    row["bf16_over_kernel"] = row["bf16_ms"] / row["kernel_ms"]
    return row


def run(shapes=tuple(SHAPES), batches=BATCHES, contexts=CONTEXTS, *, warmup: int = 3,
        repeats: int = 20, dry_run: bool = False) -> list[dict]:
    if dry_run:
        batches, contexts, warmup, repeats = DRY["batches"], DRY["contexts"], 0, 1
    return [bench_case(s, b, c, warmup=warmup, repeats=repeats, dry_run=dry_run)
            for s in shapes for b in batches for c in contexts]


def print_table(rows: list[dict]) -> None:
    cols = [c for c in rows[0] if c != "bytes"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, XLA paths")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown {name!r}; expected some of {tuple(SHAPES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU (or --dry-run); jax backend is "
                         f"{jax.default_backend()!r}")
    rows = run(tuple(args.shapes.split(",")), tuple(map(int, args.batches.split(","))),
               tuple(map(int, args.contexts.split(","))), warmup=args.warmup,
               repeats=args.repeats, dry_run=args.dry_run)
    report(rows, args.out, args.dry_run)
    return 0


def report(rows: list[dict], out: str | None, dry_run: bool) -> None:
    """Print the table; write the rows with the device and JAX version to `out` (JSON)."""
    print_table(rows)
    if out:
        with open(out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__,
                       "dry_run": dry_run, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
