r"""CPU speed of the weight schemes in one process (run by experiment.py as a subprocess so
the XLA thread count can be fixed before JAX starts, equal to llama.cpp's):

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
        python -m experiments.dynacore.speed --out speed.json --prompt 256 --context 128 \
        --decode 32 --batches 1,8 --repeats 5 --w8 '{"smooth": 0.5}' \
        --w4 '{"weight_bits": 4, "act_bits": 16, "group_size": 64, "zero_point": "float"}'

Prefill tok/s (one prompt of --prompt tokens, jitted `generate.prefill`) for f32, bf16 and
the --w8 setting (and plain W8A8 when --w8 smooths); decode tok/s
(`generate.decode_loop`, --decode greedy steps from a cache holding --context tokens) at
each batch for f32 and the --w4 setting; medians after
one warm-up round, variants interleaved (research.core.timing.time_interleaved). Also the
compiled decode step's HLO for W4A16: whether XLA writes whole dequantized weights.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from research.core.timing import time_interleaved
from research.dynacore import QuantConfig, quantize, w8a8, w8a16
from research.model import load
from research.decode.generate import decode_loop, decode_step, prefill
from research.decode.sampling import SamplingConfig
from research.transforms import CalibrationData, calibrate_and_apply


def prefill_settings(w8: QuantConfig) -> list[QuantConfig]:
    """The W8A8 settings timed at prefill: plain W8A8 beside a smoothed --w8 (isolates
    SmoothQuant's multiply), then --w8."""
    return ([w8a8()] if w8.smooth is not None else []) + [w8]


def variants(model, w8: QuantConfig, w4: QuantConfig, cal: CalibrationData) -> dict:
    """f32, bf16, the W8A8 and W4A16 settings given (calibrated on `cal` when they need
    data: the codes' values do not change the speed, their arrays and dtypes do), plain
    W8A8 beside a smoothed one, and W8A16."""
    out = {"f32": model, "bf16": model.astype(jnp.bfloat16)}
    for cfg in (*prefill_settings(w8), w8a16(), w4):
        out[cfg.name], _ = calibrate_and_apply(quantize(cfg), model, cal)
    return out


def hlo_materialization(model, batch: int = 1, context: int = 128) -> dict:
    """Compile one decode step of `model` and look for float arrays of a whole linear
    weight's shape [K, N] in the optimized HLO (a materialized dequantized weight)."""
    c = model.config
    shapes = {(c.dim, c.n_heads * c.head_dim), (c.dim, c.n_kv_heads * c.head_dim),
              (c.n_heads * c.head_dim, c.dim), (c.dim, c.ffn_dim), (c.ffn_dim, c.dim)}
    states = model.init_cache(batch, context)
    args = (model, jnp.zeros((batch,), jnp.int32), jnp.full((batch,), 16, jnp.int32),
            jnp.ones((batch,), bool), states)
    text = decode_step.lower(*args).compile().as_text()
    found = {}
    for k, n in sorted(shapes):
        pat = re.compile(rf"= f32\[{k},{n}\]")
        lines = [ln.strip()[:160] for ln in text.splitlines() if pat.search(ln)]
        found[f"{k}x{n}"] = {"count": len(lines), "examples": lines[:3]}
    dots = [ln.strip()[:200] for ln in text.splitlines() if " dot(" in ln][:4]
    fusions_with_dot = sum(1 for ln in text.splitlines()
                           if "fusion" in ln and "kind=kOutput" in ln)
    return {"weight_shaped_f32_arrays": found, "example_dots": dots,
            "output_fusions": fusions_with_dot, "hlo_chars": len(text)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default="")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--w8", default="{}", help="W8A8 QuantConfig fields as JSON")
    ap.add_argument("--w4", default='{"weight_bits": 4, "act_bits": 16, "group_size": 64}',
                    help="W4A16 QuantConfig fields as JSON")
    ap.add_argument("--cal_seqs", type=int, default=4,
                    help="calibration sequences of 128 tokens for data-aware settings")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    w8, w4 = QuantConfig(**json.loads(a.w8)), QuantConfig(**json.loads(a.w4))
    model, tok = load(a.gguf or None)
    cal = CalibrationData.from_corpus(tok, 128, a.cal_seqs)
    models = variants(model, w8, w4, cal)
    rng = np.random.default_rng(0)
    result = {"xla_flags": __import__("os").environ.get("XLA_FLAGS", ""), "prefill": {},
              "decode": {}}

    # prefill: one prompt of a.prompt tokens into a fresh cache
    toks = jnp.asarray(rng.integers(100, 40000, (1, a.prompt)), jnp.int32)
    lens = jnp.asarray([a.prompt], jnp.int32)
    pv = ["f32", "bf16", *(c.name for c in prefill_settings(w8))]
    caches = {v: models[v].init_cache(1, a.prompt) for v in pv}
    fns = {v: (lambda v=v: prefill(models[v].prefill_model, toks, lens, caches[v]))
           for v in pv}
    times = time_interleaved(fns, warmup=1, repeats=a.repeats, alternate=True)
    for v in pv:
        med = statistics.median(times[v]["wall_s"])
        result["prefill"][v] = {"median_s": med, "tok_s": a.prompt / med,
                                "wall_s": times[v]["wall_s"]}

    # decode: a.decode greedy steps from a cache holding a.context tokens
    dv = ["f32", w4.name]
    for b in (int(x) for x in a.batches.split(",")):
        ctx = jnp.asarray(rng.integers(100, 40000, (b, a.context)), jnp.int32)
        clen = jnp.full((b,), a.context, jnp.int32)
        prepared = {}
        for v in dv:
            m = models[v]
            logits, states = prefill(m.prefill_model, ctx, clen,
                                     m.init_cache(b, a.context + a.decode))
            prepared[v] = (m.decode_model, logits, states)

        def run(v):
            m, logits, states = prepared[v]
            return decode_loop(m, logits, clen, states, jax.random.key(0),
                               max_new_tokens=a.decode, sampling=SamplingConfig(),
                               stop_tokens=()).tokens

        times = time_interleaved({v: (lambda v=v: run(v)) for v in dv}, warmup=1,
                                 repeats=a.repeats, alternate=True)
        for v in dv:
            med = statistics.median(times[v]["wall_s"])
            # the first token comes from the prefill's logits: a.decode - 1 forward steps
            result["decode"][f"{v} b{b}"] = {
                "variant": v, "batch": b, "median_s": med,
                "tok_s": b * (a.decode - 1) / med, "wall_s": times[v]["wall_s"]}
    result["hlo_w4a16"] = hlo_materialization(models[w4.name])
    result["hlo_f32"] = hlo_materialization(models["f32"])
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
