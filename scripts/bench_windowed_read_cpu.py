r"""Decode step (or prefill chunk) of one paged layer on the CPU: bf16 pages vs TaSQ-like
1-bit codes (pre-RoPE keys, the default read) with and without a bfloat16 sink + recent
window.

    python scripts/bench_windowed_read_cpu.py [--batch 4] [--context 8192] [--repeats 7]
    python scripts/bench_windowed_read_cpu.py --batch 1 --chunk 512   # a prefill chunk
    python scripts/bench_windowed_read_cpu.py --dry-run     # tiny sizes

One SmolLM2-135M layer (9 query heads, 3 KV heads, head_dim 64) in the paged layout
(`PagedKVCache.update_and_attend`: write one token per row, read the row's pages through
the block table), every row `--context` tokens long. Codes and codebooks are random (times
do not depend on values): 1 bit per channel, 8-channel groups, 256 centroids, per-head
codebooks. Rows: bf16; codes (CQCodec, keys rebuilt block by block: TaSQ 1-bit's XLA
read); codes + window (WindowedCodec(codes, 4, 128): the codes' own scores and the S + W
window tokens in one softmax, research/kv/windowed.py). With `--chunk T > 1` each call
writes and reads T tokens per row ending at `--context` (a chunked-prefill piece) and a
fourth row reads the window slot by slot (`WindowedCodec._attend_by_slot`: every slot
scored from both the copies and the codes, the read before the banded one). jit, one
warm-up call each (compile seconds reported), then `--repeats` interleaved rounds; medians
of wall seconds. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from research.core.timing import time_interleaved
from research.kv.codec import FloatCodec
from research.kv.paged import PagedKVCache
from research.kv.windowed import WindowedCodec
from flax import struct

from research.tasq.cq import CQCodec

HQ, HKV, D = 9, 3, 64


def _codes_codec(rng) -> CQCodec:
    books = lambda: jnp.asarray(rng.normal(size=(HKV, D // 8, 256, 8)), jnp.float32)  # noqa
    return CQCodec(books(), books(), rope_theta=100000.0, label="tasq")


@struct.dataclass
class _SlotBySlotWindow(WindowedCodec):
    """The window read slot by slot for chunks too (the read the banded one replaced)."""

    def _chunk_attend(self, q, view):
        return self._attend_by_slot(q, view)


def _step(cache, batch, context, chunk=1):
    """A jitted step writing `chunk` tokens per row ending at `context` (state donated)
    and a filled state."""
    state = cache.init(batch, context + 16, HKV, D)
    rng = np.random.default_rng(0)
    for name, x in state.items():  # random records; the tables stay as init made them
        if name not in ("block_table", "window_table") and x.dtype == jnp.uint8:
            state[name] = jnp.asarray(rng.integers(0, 256, x.shape), jnp.uint8)
        elif name not in ("block_table", "window_table"):
            state[name] = jnp.asarray(rng.integers(0, 1 << 14, x.shape), x.dtype)
    q = jnp.asarray(rng.normal(size=(batch, chunk, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, chunk, HKV, D)), jnp.float32)
    start = jnp.full((batch,), context - chunk + 1, jnp.int32)
    n_new = jnp.full((batch,), chunk, jnp.int32)

    def step(state):  # pools updated in place (donated below), as the engine's step does
        return cache.update_and_attend(state, q, k, k, start=start, n_new=n_new, window=None)
    return jax.jit(step, donate_argnums=0), state


def _donating(step, state):
    """A call of `step` on the state its last call returned (the pools are donated)."""
    held = [state]

    def call():
        out, held[0] = step(held[0])
        return out
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=1, help="tokens per row per call")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.batch, args.context, args.repeats = 1, 256, 1
    if not 1 <= args.chunk <= args.context:
        raise SystemExit(f"--chunk must be in [1, --context], got {args.chunk}")
    codes = _codes_codec(np.random.default_rng(1))
    caches = {"bf16": PagedKVCache(FloatCodec("bfloat16")),
              "codes": PagedKVCache(codes),
              "codes+window": PagedKVCache(WindowedCodec(codes, 4, 128))}
    if args.chunk > 1:
        caches["codes+window slot by slot"] = PagedKVCache(_SlotBySlotWindow(codes, 4, 128))
    fns, compile_s = {}, {}
    for name, cache in caches.items():
        fns[name] = _donating(*_step(cache, args.batch, args.context, args.chunk))
        t0 = time.perf_counter()
        jax.block_until_ready(fns[name]())
        compile_s[name] = time.perf_counter() - t0
    times = time_interleaved(fns, warmup=0, repeats=args.repeats, alternate=True)
    times = {name: t["wall_s"] for name, t in times.items()}
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    print(json.dumps({"batch": args.batch, "context": args.context, "chunk": args.chunk,
                      "repeats": args.repeats,
                      "median_ms": {k: round(v, 2) for k, v in ms.items()},
                      "first_call_s": {k: round(v, 2) for k, v in compile_s.items()},
                      "vs_bf16": {k: round(ms["bf16"] / v, 3) for k, v in ms.items()},
                      "device": jax.devices()[0].device_kind}))


if __name__ == "__main__":
    main()
