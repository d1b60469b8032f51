r"""Whole-model decode step of SmolLM2-135M-Instruct at a long context, per KV codec.

    python scripts/bench_decode_step_long.py [--batch 4] [--context 8192] [--steps 5]
        [--codecs bf16,tasq-1bit,tasq-1bit+w128]

Each registered codec (research/serving/kv_codecs.py; calibrated ones on 4 x 256 tokens of
the calibration half) is installed in the model's caches, paged as the engine pages them
(`--layout paged`, blocks of 16; 16-bit pages stored as bits, so a step updates them in
place) or dense as `generate` keeps them (`--layout dense`: XLA:CPU copies a 16-bit dense
buffer on every update, which costs bf16 and the window's copies); one jitted decode step
(`forward` of one token per row at position `--context`, caches donated) is warmed once
(its seconds reported apart) and timed over `--steps` calls, rounds interleaved across
codecs. Decode time does not depend on what the cache holds, so the caches are left as
`init_cache` made them (no 8k prefill). Prints decode tok/s per codec and the ratio to
bf16's, as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from research.core.timing import time_interleaved
from research.kv.paged import paged_kv_cache
from research.model import forward, load
from research.serving import kv_codecs
from research.transforms import CalibrationData


def _donating(step, model, states):
    """A decode step on the cache states the last step returned (they are donated)."""
    held = [states]

    def call():
        out = step(model, held[0])
        held[0] = out.cache_states
        return out.logits
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--codecs", default="bf16,tasq-1bit,tasq-1bit+w128")
    ap.add_argument("--layout", choices=("paged", "dense"), default="paged")
    args = ap.parse_args(argv)
    model, tok = load(None)
    calib = CalibrationData.from_corpus(tok, 256, 4)
    tokens = jnp.full((args.batch, 1), 42, jnp.int32)
    start = jnp.full((args.batch,), args.context, jnp.int32)
    fns, first = {}, {}
    for name in args.codecs.split(","):
        spec = kv_codecs.get(name)
        m = kv_codecs.codec_model(model, name, calibration=calib if spec.calibrated else None)
        if args.layout == "paged":
            m = paged_kv_cache(block_size=16).apply(m, ())
        step = jax.jit(lambda m, states: forward(m, tokens, cache_states=states, start=start,
                                                 logits="last"), donate_argnums=1)
        fns[name] = _donating(step, m, m.init_cache(args.batch, args.context + 16))
        t0 = time.perf_counter()
        jax.block_until_ready(fns[name]())
        first[name] = time.perf_counter() - t0
    times = time_interleaved(fns, warmup=0, repeats=args.steps, alternate=True)
    tok_s = {n: args.batch / statistics.median(t["wall_s"]) for n, t in times.items()}
    base = tok_s.get("bf16")
    print(json.dumps({"batch": args.batch, "context": args.context, "steps": args.steps,
                      "layout": args.layout,
                      "decode_tok_s": {n: round(v, 2) for n, v in tok_s.items()},
                      "vs_bf16": {n: round(v / base, 3) for n, v in tok_s.items()} if base
                      else None,
                      "first_call_s": {n: round(v, 1) for n, v in first.items()},
                      "device": jax.devices()[0].device_kind}))


if __name__ == "__main__":
    main()
