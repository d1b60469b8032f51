"""Long-context experiment (see long_context.py for the command and what is measured)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.serving.overhead_experiment import release_compiled
from research import data
from research.model import load
from research.serving.api import Request, SamplingParams

TECHNIQUE = "serving"
DEFAULTS_CHOSEN_ON = "none: a-priori engine settings, speed only (no quality is scored)"

COLUMNS = ["context", "prompt_tokens", "codec", "decode_tok_s", "vs_bf16", "step_ms", "prefill_s",
           "kv_bytes_per_token", "seqs_at_budget", "seqs_vs_bf16"]


def defaults(config) -> dict:
    return {k: config[k] for k in ("batch", "block_size", "prefill_chunk", "min_read_len",
                                   "budget_gib")}


def served_model(model, tok, codec: str, config):
    """`model` with the KV codec `codec` (the server's names, plus TaSQ post-RoPE)."""
    from research.serving.server import kv_codec_model
    if codec != "tasq-1bit-post-rope":
        return kv_codec_model(model, tok, codec, seed=config.seed,
                              calibration_seqs=config.calibration_seqs)
    from research.tasq import TaSQConfig, tasq
    from research.transforms import CalibrationData, calibrate_and_apply
    ids = tok.encode(data.corpus_text("calibration"))
    cal = CalibrationData.from_ids(ids, 256, config.calibration_seqs)
    cfg = TaSQConfig(bits=1, seed=config.seed, key_space="post_rope")
    return calibrate_and_apply(tasq(cfg), model, cal)[0]


def decode_speed(served, tok, prompts, config) -> dict:
    """Prefill every prompt (chunked, through the engine), then time decode steps of the
    full batch with the engine's own primitives (prefill / insert / generate)."""
    from research.serving.engine import ServingEngine
    bs = config.block_size
    max_len = len(prompts[0]) + config.decode_steps + 1
    per_seq = -(-max_len // bs)
    engine = ServingEngine(
        served, tok, n_blocks=(len(prompts) + 1) * per_seq + 1, block_size=bs,
        max_batch=len(prompts), max_len=max_len, token_budget=config.prefill_chunk,
        prefill_chunk=config.prefill_chunk, max_prefill_rows=1, prefix_cache=False,
        min_read_len=config.min_read_len, max_queue=len(prompts), stop_token_ids=())
    t0 = time.perf_counter()
    for slot, p in enumerate(prompts):
        prefix = engine.prefill(Request(f"r{slot}", tuple(p), SamplingParams(
            max_new_tokens=config.decode_steps + 1)))
        engine.insert(prefix, slot)
    prefill_s = time.perf_counter() - t0
    steps = []
    for _ in range(config.decode_steps):
        t = time.perf_counter()
        _, toks = engine.generate(engine.state)
        steps.append(time.perf_counter() - t)
        assert all(len(x) == 1 for x in toks), toks  # every row decoded one token
    step = float(np.median(steps[1:]))
    return {"decode_tok_s": len(prompts) / step, "step_ms": step * 1e3,
            "prefill_s": prefill_s, "block_bytes": engine.pool.block_bytes,
            "compiles_while_serving": engine.metrics().compiles}


def prefill_memory(model, batch: int, context: int, chunk: int) -> dict:
    """Bytes XLA plans (arguments + temporaries) for one generate prefill of
    batch x context tokens in one piece and in `chunk`-token pieces (bf16 cache)."""
    from research.model.precision import kv_cache_dtype
    from research.serving import generate as G
    from research.transforms import calibrate_and_apply
    m = calibrate_and_apply(kv_cache_dtype("bfloat16"), model, None)[0]
    states = jax.eval_shape(lambda: m.init_cache(batch, context + 16))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731

    def planned(fn, *args):
        mem = fn.lower(m, *args).compile().memory_analysis()
        return int(mem.argument_size_in_bytes + mem.temp_size_in_bytes
                   + mem.output_size_in_bytes - mem.alias_size_in_bytes)

    return {"one_piece_bytes": planned(G.prefill_piece, i32(batch, context), i32(batch),
                                       i32(batch), states),
            "chunked_bytes": planned(G.prefill_piece, i32(batch, chunk), i32(batch),
                                     i32(batch), states)}


def run(config, out_dir) -> common.Report:
    del out_dir
    model, tok = load(config.gguf_path or None)
    ids = tok.encode(data.corpus_text(config.text_split))
    rows, extra = [], {}
    budget = config.budget_gib * 2**30
    for context in config.contexts:
        if len(ids) < config.batch * context:
            raise ValueError(f"the {config.text_split} text has {len(ids)} tokens, fewer "
                             f"than batch x context = {config.batch * context}")
        # a prompt and its decoded tokens must fit the model's positions: at the trained
        # length (8192) the prompt is context - decode_steps - 1 tokens
        n = min(context, model.config.max_position - config.decode_steps - 1)
        prompts = [ids[i * n:(i + 1) * n] for i in range(config.batch)]
        for codec in config.codecs:
            r = decode_speed(served_model(model, tok, codec, config), tok, prompts, config)
            per_seq_bytes = -(-context // config.block_size) * r["block_bytes"]
            row = {"context": context, "prompt_tokens": n, "codec": codec,
                   "decode_tok_s": r["decode_tok_s"],
                   "step_ms": r["step_ms"], "prefill_s": r["prefill_s"],
                   "kv_bytes_per_token": r["block_bytes"] / config.block_size,
                   "seqs_at_budget": int(budget // per_seq_bytes),
                   "compiles_while_serving": r["compiles_while_serving"]}
            print(row, flush=True)
            rows.append(row)
            release_compiled()
    for row in rows:
        ref = next(r for r in rows if r["context"] == row["context"] and r["codec"] == "bf16")
        row["vs_bf16"] = row["decode_tok_s"] / ref["decode_tok_s"]
        row["seqs_vs_bf16"] = row["seqs_at_budget"] / max(1, ref["seqs_at_budget"])
    extra["prefill_memory"] = prefill_memory(model, config.memory_batch,
                                             config.memory_context, config.prefill_chunk)
    print(extra, flush=True)
    claims = [{"claim": f"TaSQ 1-bit ({r['codec']}) / bf16 decode tok/s at {config.batch} x "
                        f"{r['context']}", "target": ">= 2", "measured": r["vs_bf16"],
               "met": r["vs_bf16"] >= 2} for r in rows if r["codec"].startswith("tasq")]
    mem = extra["prefill_memory"]
    notes = [f"batch {config.batch}, {config.decode_steps} decode steps (median of all but "
             f"the first), prompts = consecutive tokens of the text; prefill "
             f"through the engine in {config.prefill_chunk}-token chunks; reads bucketed "
             f"from {config.min_read_len} tokens",
             f"seqs_at_budget: {config.budget_gib} GiB / (blocks of a context-length "
             "sequence x the pool's measured block bytes)",
             f"generate prefill of {config.memory_batch} x {config.memory_context} (f32 "
             f"weights, bf16 cache), XLA-planned bytes: one piece {mem['one_piece_bytes'] / 2**30:.1f} GiB, 512-token pieces "
             f"{mem['chunked_bytes'] / 2**30:.2f} GiB", f"prompts from the {config.text_split} split"]
    return common.Report(columns=COLUMNS, rows=rows, claims=claims, notes=notes, extra=extra,
                         title="Long-context decode by KV codec through the engine (CPU)",
                         plot=lambda fig: _plot(fig, rows, config))


def _plot(fig, rows, config):
    for i, context in enumerate(config.contexts):
        ax = fig.add_subplot(1, len(config.contexts), i + 1)
        sub = [r for r in rows if r["context"] == context]
        ax.bar(range(len(sub)), [r["decode_tok_s"] for r in sub])
        ax.set_xticks(range(len(sub)), [r["codec"].replace("-", "\n", 1) for r in sub])
        ax.set_title(f"{config.batch} x {context} tokens")
        ax.set_ylabel("decode tok/s")
