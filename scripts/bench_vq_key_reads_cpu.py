r"""Decode-step attention read of one layer on the CPU: the three ways TaSQ's 1-bit codes
score keys, against bf16.

    python scripts/bench_vq_key_reads_cpu.py [--batch 4] [--context 8192] [--repeats 7]
    python scripts/bench_vq_key_reads_cpu.py --dry-run     # tiny sizes (the test)

One SmolLM2-135M layer (9 query heads, 3 KV heads, head_dim 64), one query token per row,
every row `--context` tokens long, in one process (jit, one warm-up round for compilation,
then `--repeats` interleaved rounds with the order reversed every other round; medians of
wall and process-CPU seconds):
  bf16:     core masked GQA attention over dense bf16 K/V (the bf16 codec's XLA read);
  post:     post-RoPE codes through one lookup table per query (vq_decode_attention_reference);
  rebuild:  pre-RoPE codes, keys rebuilt block by block and rotated
            (vq_decode_attention_pre_rope: TaSQ's default XLA read);
  rotated:  pre-RoPE codes in whole-RoPE-pair groups through one rotated table per query
            (rotated.vq_decode_attention_rotated: key_read="rotated_table").
The three code reads share the value path (per-code bins); `*_keys` rows time the key
scores alone (post: table gathers; rebuild: the rebuild pass; rotated: the rotated
gathers), so the difference between key reads is not hidden by the values.
Codes and codebooks are random (times do not depend on values). Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.vq_attention.reference import (flat_centroids, lookup_tables,
                                                   scores_from_codes,
                                                   vq_decode_attention_pre_rope,
                                                   vq_decode_attention_reference)
from kernels_pallas.vq_attention.rope import KeyRope
from kernels_pallas.vq_attention.rotated import (PairTables, rotated_scores, rotated_tables,
                                                 vq_decode_attention_rotated)
from research.core.attention import attend
from research.core.timing import time_interleaved

HQ, HKV, D, GROUP, CENTROIDS, THETA = 9, 3, 64, 8, 256, 100000.0


def rebuild_keys(q, k_codes, k_codebook, key_rope, block=512):
    """The key pass of vq_decode_attention_pre_rope alone (scores [B, Hkv, gq, S])."""
    b, hq, d = q.shape
    _, s, hkv, g = k_codes.shape
    n = s // block
    codes = jnp.moveaxis(k_codes.reshape(b, n, block, hkv, g), 1, 0)
    table, first = flat_centroids(k_codebook, hkv)
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) / math.sqrt(d)
    cos_j, sin_j = (x[None] for x in key_rope.cos_sin(jnp.arange(block)))

    def one(xs):
        c, i = xs
        keys = jnp.take(table, first + c.astype(jnp.int32), axis=0).reshape(b, block, hkv, d)
        qa, qb = key_rope.query_terms(qg, i * block)
        return (jnp.einsum("bkjd,bskd->bkjs", qa, keys * cos_j)
                + jnp.einsum("bkjd,bskd->bkjs", qb, keys * sin_j))
    return jax.lax.map(one, (codes, jnp.arange(n)))


def post_keys(q, k_codes, k_codebook):
    lut = lookup_tables(q[:, None], k_codebook, HKV, 1 / math.sqrt(D))  # [B, H, R, G, K]
    return jax.vmap(jax.vmap(scores_from_codes, in_axes=(0, 1)))(lut, k_codes)


def rotated_keys(q, k_codes, k_codebook, pairs, block=512):
    b, s = k_codes.shape[:2]
    tables = rotated_tables(q[:, None], k_codebook, pairs, 1 / math.sqrt(D))
    codes = jnp.moveaxis(k_codes.reshape(b, s // block, block, HKV, -1), 1, 0)
    local = pairs.cos_sin(jnp.arange(block))
    return jax.lax.map(lambda xs: rotated_scores(tables, xs[0], pairs.shifted(
        local, xs[1] * block)), (codes, jnp.arange(s // block)))


def pair_perm(rng):
    """A random codec order of whole-pair groups per KV head (as TaSQ calibrates)."""
    rows = []
    for _ in range(HKV):
        pairs = rng.permutation(D // 2).reshape(-1, GROUP // 2)
        rows.append(np.concatenate([pairs, pairs + D // 2], axis=1).reshape(-1))
    return np.stack(rows).astype(np.int32)


def run(batch: int, context: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    g = D // GROUP
    q = jnp.asarray(rng.normal(size=(batch, HQ, D)), jnp.float32)
    k_codes, v_codes = (jnp.asarray(rng.integers(0, CENTROIDS, (batch, context, HKV, g)),
                                    jnp.uint8) for _ in range(2))
    k_cb, v_cb = (jnp.asarray(rng.normal(size=(HKV, g, CENTROIDS, GROUP)), jnp.float32)
                  for _ in range(2))
    k16, v16 = (jnp.asarray(rng.normal(size=(batch, context, HKV, D)), jnp.bfloat16)
                for _ in range(2))
    lengths = jnp.full((batch,), context, jnp.int32)
    perm = pair_perm(rng)
    key_rope = KeyRope.from_permutation(perm, THETA)
    pairs = PairTables.from_permutation(perm, GROUP, THETA)
    pos = jnp.broadcast_to(jnp.arange(context), (batch, context))

    def bf16(q, k, v):
        return attend(q[:, None].astype(jnp.bfloat16), k, v, (lengths - 1)[:, None], pos,
                      pos < lengths[:, None], None)

    fns = {
        "bf16": (jax.jit(bf16), (q, k16, v16)),
        "post": (jax.jit(vq_decode_attention_reference), (q, k_codes, v_codes, k_cb, v_cb,
                                                          lengths)),
        "rebuild": (jax.jit(vq_decode_attention_pre_rope),
                    (q, k_codes, v_codes, k_cb, v_cb, lengths, key_rope)),
        "rotated": (jax.jit(vq_decode_attention_rotated),
                    (q, k_codes, v_codes, k_cb, v_cb, lengths, pairs)),
        "post_keys": (jax.jit(post_keys), (q, k_codes, k_cb)),
        "rebuild_keys": (jax.jit(rebuild_keys), (q, k_codes, k_cb, key_rope)),
        "rotated_keys": (jax.jit(rotated_keys), (q, k_codes, k_cb, pairs)),
    }
    times = time_interleaved({n: (lambda f=f, a=a: f(*a)) for n, (f, a) in fns.items()},
                             warmup=1, repeats=repeats, alternate=True)
    ms = {n: {"wall_ms": 1e3 * statistics.median(t["wall_s"]),
              "cpu_ms": 1e3 * statistics.median(t["cpu_s"])} for n, t in times.items()}
    rot = fns["rotated"][0](*fns["rotated"][1])
    reb = fns["rebuild"][0](*fns["rebuild"][1])
    return {"batch": batch, "context": context, "repeats": repeats,
            "device": jax.devices()[0].device_kind, "ms": ms,
            "bf16_over": {n: ms["bf16"]["wall_ms"] / ms[n]["wall_ms"]
                          for n in ("post", "rebuild", "rotated")},
            "rotated_vs_rebuild_max_abs_diff": float(jnp.max(jnp.abs(rot - reb)))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    if a.context % 512 and not a.dry_run:
        raise ValueError(f"--context must be a multiple of 512 (the read's block), got "
                         f"{a.context}")
    report = run(2, 512, 1) if a.dry_run else run(a.batch, a.context, a.repeats)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
