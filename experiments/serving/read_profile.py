r"""Where a decode step's KV read goes, per codec, on one SmolLM2 attention layer (CPU XLA).

Command:   python -m experiments.run --config=experiments/serving/read_profile.py:small
Hardware:  CPU, ~3 minutes.
What:      one decode query per row over `batch` x `context` cached tokens of a SmolLM2
           layer (9 query / 3 KV heads, head dim 64), the XLA read each codec takes on
           this CPU, timed interleaved (medians of `repeats` after a warm-up), plus the
           pieces of TaSQ's default pre-RoPE read run alone: rebuilding the keys from the
           codebook, rebuilding and rotating them, and the whole read. Random codes and
           codebooks of TaSQ 1-bit's shapes (8 groups of 8 channels, 256 centroids):
           time and bytes do not depend on the values. Bytes are those of the arrays
           each read takes (real arrays).
Why:       issue 34 asks what limits TaSQ's decode speed at long context on this CPU;
           this separates bytes read from work done per cached token.
Nothing is tuned or scored here.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import common
from kernels_pallas.vq_attention.reference import (flat_centroids, vq_decode_attention_pre_rope,
                                                   vq_decode_attention_reference)
from kernels_pallas.vq_attention.rope import KeyRope
from research.core.timing import time_interleaved

TECHNIQUE = "serving"
DEFAULTS_CHOSEN_ON = "none: a-priori shapes, speed only"
COLUMNS = ["read", "ms", "vs_bf16", "kv_bytes_read", "note"]


def defaults(config) -> dict:
    return {k: config[k] for k in ("batch", "context", "block")}


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.serving.read_profile", args=("small",),
                          run_name="serving_read_profile", gguf_path=None)
    c.batch, c.context = 4, 8192
    c.n_heads, c.n_kv_heads, c.head_dim = 9, 3, 64
    c.group, c.centroids = 8, 256  # TaSQ 1-bit: 8 channels per code, 2^8 centroids
    c.block = 512  # keys rebuilt per step of the pre-RoPE read (CQCodec.block)
    c.rope_theta = 100000.0
    c.warmup, c.repeats = 2, 7
    return c


def inputs(config) -> dict:
    b, s, hq, hkv, d = (config.batch, config.context, config.n_heads, config.n_kv_heads,
                        config.head_dim)
    n_groups = d // config.group
    key = iter(jax.random.split(jax.random.key(config.seed), 8))
    codes = lambda: jax.random.randint(next(key), (b, s, hkv, n_groups), 0,  # noqa: E731
                                       config.centroids).astype(jnp.uint8)
    book = lambda: jax.random.normal(next(key), (hkv, n_groups, config.centroids,  # noqa: E731
                                                 config.group), jnp.float32)
    return {"q": jax.random.normal(next(key), (b, hq, d), jnp.float32),
            "k": jax.random.normal(next(key), (b, s, hkv, d)).astype(jnp.bfloat16),
            "v": jax.random.normal(next(key), (b, s, hkv, d)).astype(jnp.bfloat16),
            "k_codes": codes(), "v_codes": codes(), "k_book": book(), "v_book": book(),
            "lengths": jnp.full((b,), s, jnp.int32),
            "rope": KeyRope.from_permutation(jnp.tile(jnp.arange(d)[None], (hkv, 1)),
                                             config.rope_theta)}


def dense_read(q, k, v, lengths):
    """bf16 pages' XLA read: scores over dense keys, softmax, weighted values (f32 math)."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d) / math.sqrt(d)
    scores = jnp.einsum("bkjd,bskd->bkjs", qg, k.astype(jnp.float32))
    mask = jnp.arange(k.shape[1])[None, None, None, :] < lengths[:, None, None, None]
    w = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkjs,bskd->bkjd", w, v.astype(jnp.float32)).reshape(b, hq, d)


def rebuild_keys(k_codes, k_book, block: int, rope=None, q=None):
    """Pieces of the pre-RoPE read's first pass, block by block as it runs them: keys
    gathered from the centroid table; with `rope`, also rotated at their positions (the
    cos and sin products); with `q` too, scored against the query (its two einsums).
    Reduced at the end so nothing is dead code."""
    b, s, hkv, g = k_codes.shape
    table, first = flat_centroids(k_book, hkv)
    d = g * table.shape[1]
    blocks = jnp.moveaxis(k_codes.reshape(b, s // block, block, hkv, g), 1, 0)
    cos, sin = (None, None) if rope is None else rope.cos_sin(jnp.arange(block))
    qg = None if q is None else q.reshape(b, hkv, q.shape[1] // hkv, d)

    def one(block_codes):
        keys = jnp.take(table, first + block_codes.astype(jnp.int32), axis=0)
        keys = keys.reshape(b, block, hkv, d)
        if rope is None:
            return keys.sum(axis=1)
        kc, ks = keys * cos[None], keys * sin[None]
        if qg is None:
            return (kc + ks).sum(axis=1)
        return (jnp.einsum("bkjd,bskd->bkjs", qg, kc)
                + jnp.einsum("bkjd,bskd->bkjs", qg, ks)).sum(axis=-1)

    return jax.lax.map(one, blocks).sum(axis=0)


def run(config, out_dir=None) -> common.Report:
    del out_dir
    if config.context % config.block:
        raise ValueError(f"context {config.context} must be a multiple of block "
                         f"{config.block}")
    x = inputs(config)
    reads = {
        "bf16 dense keys and values (XLA)": jax.jit(dense_read),
        "TaSQ post-RoPE: query x centroid tables, gather by code": jax.jit(
            lambda q, kc, vc, kb, vb, n: vq_decode_attention_reference(q, kc, vc, kb, vb, n)),
        "TaSQ pre-RoPE (default): rebuild + rotate keys per block": jax.jit(
            lambda q, kc, vc, kb, vb, n: vq_decode_attention_pre_rope(
                q, kc, vc, kb, vb, n, x["rope"], config.block)),
        "  its key rebuild alone (centroid gather)": jax.jit(
            lambda kc, kb: rebuild_keys(kc, kb, config.block)),
        "  its key rebuild + rotation (no scores)": jax.jit(
            lambda kc, kb: rebuild_keys(kc, kb, config.block, x["rope"])),
        "  its whole first pass (rebuild, rotate, score)": jax.jit(
            lambda kc, kb: rebuild_keys(kc, kb, config.block, x["rope"], x["q"])),
    }
    coded = (x["q"], x["k_codes"], x["v_codes"], x["k_book"], x["v_book"], x["lengths"])
    args = {name: ((x["q"], x["k"], x["v"], x["lengths"]) if name.startswith("bf16") else
                   (x["k_codes"], x["k_book"]) if name.startswith("  ") else coded)
            for name in reads}
    times = time_interleaved({n: (lambda n=n: reads[n](*args[n])) for n in reads},
                             warmup=config.warmup, repeats=config.repeats, alternate=True)
    ms = {n: float(np.median(t["wall_s"])) * 1e3 for n, t in times.items()}
    bf16 = ms["bf16 dense keys and values (XLA)"]
    nbytes = lambda *a: sum(int(t.nbytes) for t in a)  # noqa: E731
    tokens = config.batch * config.context
    rebuilt = tokens * config.n_kv_heads * config.head_dim * 4
    notes_by_read = {
        "bf16 dense keys and values (XLA)": "reads K and V once",
        "TaSQ post-RoPE: query x centroid tables, gather by code":
            "per token: one table lookup per code group, no key built",
        "TaSQ pre-RoPE (default): rebuild + rotate keys per block":
            f"builds {rebuilt / 2**20:.0f} MiB of f32 keys per step, block by block",
        "  its key rebuild alone (centroid gather)": "part of the row above",
        "  its key rebuild + rotation (no scores)": "part of the row above",
        "  its whole first pass (rebuild, rotate, score)":
            "the rest of the read: softmax and the per-code value bins"}
    rows = []
    for n in reads:
        read = (nbytes(x["k"], x["v"]) if n.startswith("bf16") else
                nbytes(x["k_codes"]) if n.startswith("  ") else
                nbytes(x["k_codes"], x["v_codes"]))
        rows.append({"read": n, "ms": ms[n], "vs_bf16": ms[n] / bf16, "kv_bytes_read": read,
                     "note": notes_by_read[n]})
    pre = ms["TaSQ pre-RoPE (default): rebuild + rotate keys per block"]
    rot = ms["  its key rebuild + rotation (no scores)"]
    first = ms["  its whole first pass (rebuild, rotate, score)"]
    claims = [common.claim("share of the pre-RoPE read spent rebuilding and rotating keys",
                           "report", f"{rot / pre:.0%}", None),
              common.claim("share of the pre-RoPE read in its first pass (keys to scores)",
                           "report", f"{first / pre:.0%}", None)]
    notes = [f"{config.batch} x {config.context} tokens, one layer, {jax.default_backend()}; "
             f"medians of {config.repeats} interleaved rounds after {config.warmup} "
             "warm-up rounds; kv_bytes_read: the arrays the read takes (codes: uint8 per "
             "group; bf16 K and V)"]
    return common.Report(columns=COLUMNS, rows=rows, claims=claims, notes=notes,
                         title="Decode KV read per codec on one SmolLM2 layer (CPU XLA)",
                         plot=lambda fig: _plot(fig, rows))


def _plot(fig, rows):
    ax = fig.add_subplot(1, 1, 1)
    ax.barh(range(len(rows)), [r["ms"] for r in rows])
    ax.set_yticks(range(len(rows)), [r["read"].strip()[:48] for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode read (one layer)")
