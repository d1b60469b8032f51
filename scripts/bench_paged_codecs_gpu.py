r"""Benchmark decode attention over compressed KV pages on a GPU: the paged kernels that read
int8 and TaSQ-code pages through the block table vs the gather-then-attend path they replace.

    python scripts/bench_paged_codecs_gpu.py [--batches 4,32] [--contexts 4096,8192,32768]
        [--out paged_codecs.json]
    python scripts/bench_paged_codecs_gpu.py --dry-run   # CPU: tiny sizes, bookkeeping

SmolLM2 layer (9 q heads, 3 KV heads, D=64), 16-token pages in a shuffled pool, every row
`context` tokens long. In one process, after warm-up, medians of `--repeats` runs (ms):
  bf16_paged:     float pages, kernels_pallas.paged_attention (the reference point);
  int8_paged:     int8 pages + float16 scales, the same kernel dequantizing page tiles;
  int8_gather:    the path before: gather each row's pages, dequantize, XLA attention;
  tasq_paged:     1-bit VQ code pages (8 x 8-channel groups, 256 centroids per head),
                  kernels_pallas.vq_attention.paged, post-RoPE codes;
  tasq_gather:    the path before: gather code rows, then the dense VQ Triton kernel;
  tasq_pre_paged / tasq_pre_gather: the same with keys coded before RoPE (TaSQ's default).
Each kernel is checked against its XLA reference first (rel_err). Reported: times, the
gather/paged ratios, and bytes read per path (codes + scales of the attended tokens).
--dry-run: CPU, tiny sizes, the Pallas kernels in interpret mode.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vq_attention_gpu as vq_bench  # noqa: E402
from kernels_pallas.paged_attention import paged_decode_attention  # noqa: E402
from kernels_pallas.paged_attention.reference import gather_sequences  # noqa: E402
from kernels_pallas.vq_attention import (KeyRope, vq_decode_attention,  # noqa: E402
                                         vq_decode_attention_paged_codes)
from research.core.timing import time_fn  # noqa: E402
from research.kv.quantized import quantize_int8  # noqa: E402

HQ, HKV, D, PAGE, GROUPS, CENTROIDS = 9, 3, 64, 16, 8, 256
BATCHES, CONTEXTS = (4, 32), (4096, 8192, 32768)
DRY = dict(batches=(2,), contexts=(48,))


def inputs(rng, batch: int, context: int) -> dict:
    m = -(-context // PAGE)
    n = batch * m
    table = jnp.asarray(rng.permutation(n).reshape(batch, m), jnp.int32)
    floats = lambda: jnp.asarray(rng.normal(size=(n, PAGE, HKV, D)), jnp.float32)  # noqa
    (k8, ks), (v8, vs) = quantize_int8(floats()), quantize_int8(floats())
    codes = lambda: jnp.asarray(rng.integers(0, CENTROIDS, (n, PAGE, HKV, GROUPS)),  # noqa
                                jnp.uint8)
    book = lambda: jnp.asarray(rng.normal(size=(HKV, GROUPS, CENTROIDS, D // GROUPS)),  # noqa
                               jnp.float32)
    perm = np.stack([rng.permutation(D) for _ in range(HKV)])
    return dict(q=jnp.asarray(rng.normal(size=(batch, HQ, D)), jnp.float32),
                bf16=(floats().astype(jnp.bfloat16), floats().astype(jnp.bfloat16)),
                int8=(k8, v8, ks, vs), codes=(codes(), codes(), book(), book()),
                rope=KeyRope.from_permutation(perm, 10000.0), table=table,
                lengths=jnp.full((batch,), context, jnp.int32))


def paths(x, impl: str, interpret: bool) -> dict:
    """{name: (fn, args)}; `impl` "pallas" on the GPU, interpret on CPU dry runs."""
    q, table, lengths = x["q"], x["table"], x["lengths"]
    kw = dict(implementation="pallas", interpret=interpret)
    k8, v8, ks, vs = x["int8"]
    kc, vc, kb, vb = x["codes"]

    def int8_gather(q, k8, v8, ks, vs, table, lengths):  # the XLA path: gather + dequantize
        return paged_decode_attention(q, k8, v8, table, lengths, k_scale=ks, v_scale=vs,
                                      implementation="xla")

    def tasq_gather(q, kc, vc, kb, vb, table, lengths, rope):  # gather rows, dense kernel
        rows = lambda p: gather_sequences(p, table)  # noqa: E731
        return vq_decode_attention(q, rows(kc), rows(vc), kb, vb, lengths, key_rope=rope,
                                   **kw)

    def tasq_paged(q, kc, vc, kb, vb, table, lengths, rope):
        return vq_decode_attention_paged_codes(q, kc, vc, kb, vb, table, lengths,
                                               key_rope=rope, **kw)

    codes = (q, kc, vc, kb, vb, table, lengths)
    return {
        "bf16_paged": (lambda q, k, v, t, n: paged_decode_attention(q.astype(jnp.bfloat16),
                                                                    k, v, t, n, **kw),
                       (q, *x["bf16"], table, lengths)),
        "int8_paged": (lambda q, k, v, ks, vs, t, n: paged_decode_attention(
            q, k, v, t, n, k_scale=ks, v_scale=vs, **kw), (q, k8, v8, ks, vs, table, lengths)),
        "int8_gather": (int8_gather, (q, k8, v8, ks, vs, table, lengths)),
        "tasq_paged": (tasq_paged, codes + (None,)),
        "tasq_gather": (tasq_gather, codes + (None,)),
        "tasq_pre_paged": (tasq_paged, codes + (x["rope"],)),
        "tasq_pre_gather": (tasq_gather, codes + (x["rope"],)),
    }


def references(x) -> dict:
    """XLA references of the kernels' outputs."""
    q, table, lengths = x["q"], x["table"], x["lengths"]
    k8, v8, ks, vs = x["int8"]
    kc, vc, kb, vb = x["codes"]
    paged_ref = lambda rope: vq_decode_attention_paged_codes(  # noqa: E731
        q, kc, vc, kb, vb, table, lengths, key_rope=rope, implementation="xla")
    int8 = paged_decode_attention(q, k8, v8, table, lengths, k_scale=ks, v_scale=vs,
                                  implementation="xla")
    return {"int8_paged": int8, "int8_gather": int8, "tasq_paged": paged_ref(None),
            "tasq_gather": paged_ref(None), "tasq_pre_paged": paged_ref(x["rope"]),
            "tasq_pre_gather": paged_ref(x["rope"]),
            "bf16_paged": paged_decode_attention(q.astype(jnp.bfloat16), *x["bf16"], table,
                                                 lengths, implementation="xla")}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))


def bench_case(batch: int, context: int, *, warmup: int, repeats: int, dry_run: bool,
               seed: int = 0) -> dict:
    x = inputs(np.random.default_rng(seed), batch, context)
    want = references(x)
    tokens = batch * context
    row = {"batch": batch, "context": context, "page": PAGE,
           "bytes": {"bf16": tokens * HKV * D * 2 * 2, "int8": tokens * HKV * (D + 2) * 2,
                     "tasq": tokens * HKV * GROUPS * 2}}
    for name, (fn, args) in paths(x, "pallas", interpret=dry_run).items():
        jitted = jax.jit(fn)
        try:
            row[f"{name}_rel_err"] = rel_err(jitted(*args), want[name])
            row[f"{name}_ms"] = time_fn(lambda: jitted(*args), warmup=warmup,
                                        repeats=repeats)["median_s"] * 1e3
        except Exception as e:  # noqa: BLE001 - a compile error is a result
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
    for codec in ("int8", "tasq", "tasq_pre"):
        paged, gather = row.get(f"{codec}_paged_ms"), row.get(f"{codec}_gather_ms")
        if paged and gather:
            row[f"{codec}_gather_over_paged"] = gather / paged
        if paged and row.get("bf16_paged_ms"):
            row[f"{codec}_paged_speedup_vs_bf16"] = row["bf16_paged_ms"] / paged
    return row


def run(batches=BATCHES, contexts=CONTEXTS, *, warmup: int = 3, repeats: int = 20,
        dry_run: bool = False) -> list[dict]:
    if dry_run:
        batches, contexts, warmup, repeats = DRY["batches"], DRY["contexts"], 0, 1
    return [bench_case(b, c, warmup=warmup, repeats=repeats, dry_run=dry_run)
            for b in batches for c in contexts]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if not args.dry_run and jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU (or --dry-run); jax backend is "
                         f"{jax.default_backend()!r}")
    rows = run(tuple(map(int, args.batches.split(","))),
               tuple(map(int, args.contexts.split(","))), warmup=args.warmup,
               repeats=args.repeats, dry_run=args.dry_run)
    text = json.dumps(rows, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
