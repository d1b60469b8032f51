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
codecs. The caches are the ones `init_cache` made (no 8k prefill), their uint8 leaves
filled with random codes (`--zero_codes`: left zero; experiments/serving/decode_step.py
says why it matters). Prints decode tok/s per codec and the ratio to
bf16's, as JSON.
"""
from __future__ import annotations

import argparse
import json

import jax

from experiments.serving.decode_step import decode_step, time_decode_steps
from research.model import load
from research.serving import kv_codecs
from research.transforms import CalibrationData


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--codecs", default="bf16,tasq-1bit,tasq-1bit+w128")
    ap.add_argument("--layout", choices=("paged", "dense"), default="paged")
    ap.add_argument("--zero_codes", action="store_true",
                    help="leave uint8 cache leaves zero (init_cache) instead of random codes")
    args = ap.parse_args(argv)
    model, tok = load(None)
    calib = CalibrationData.from_corpus(tok, 256, 4)
    fns = {}
    for name in args.codecs.split(","):
        spec = kv_codecs.get(name)
        m = kv_codecs.codec_model(model, name, calibration=calib if spec.calibrated else None)
        fns[name] = decode_step(m, args.batch, args.context, paged=args.layout == "paged",
                                fill_codes=not args.zero_codes)
    seconds, first = time_decode_steps(fns, args.steps)
    tok_s = {n: args.batch / s for n, s in seconds.items()}
    base = tok_s.get("bf16")
    print(json.dumps({"batch": args.batch, "context": args.context, "steps": args.steps,
                      "layout": args.layout, "codes": "zero" if args.zero_codes else "random",
                      "decode_tok_s": {n: round(v, 2) for n, v in tok_s.items()},
                      "vs_bf16": {n: round(v / base, 3) for n, v in tok_s.items()} if base
                      else None,
                      "first_call_s": {n: round(v, 1) for n, v in first.items()},
                      "device": jax.devices()[0].device_kind}))


if __name__ == "__main__":
    main()
