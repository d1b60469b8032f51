"""Baseline measurements of the core (see baseline.py for the command)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, protocol
from research import data
from research.core.timing import time_fn
from research.eval.perplexity import perplexity, windows
from research.kv import memory
from research.model import load
from research.decode import generate as gen
from research.model.precision import kv_cache_dtype, weights_dtype
from research.transforms import chain

# the dev/test protocol (experiments/protocol.py): the baseline tunes nothing
TECHNIQUE = "baseline"
DEFAULTS_CHOSEN_ON = "nothing chosen: the model as loaded, f32 and bf16"


def defaults(config) -> dict:
    return {"dtypes": list(config.throughput.dtypes)}


def baseline_text(config) -> str:
    """A file's text, or the split's (config.test_text "stdlib": the fresh test text)."""
    if config.text_path or config.get("test_text", "pydoc") == "pydoc":
        return data.load_text(config.text_path, split=config.text_split)
    return data.split_text(config.text_split, config.test_text)


def test_items(config) -> list:
    """The perplexity windows this run scores (the item ledger, experiments/protocol.py)."""
    tok = common.tokenizer_only(config.gguf_path or None)
    ids = tok.encode(baseline_text(config))
    p = config.ppl
    spans = [(w.begin, w.end) for w in windows(len(ids), p.window, p.stride)
             [:p.max_windows or None]]
    doc = config.text_path or f"pydoc {config.text_split} half"
    return protocol.text_windows(ids, spans, doc)


VARIANTS = {"float32": chain(), "bfloat16": chain(weights_dtype("bfloat16"),
                                                  kv_cache_dtype("bfloat16"))}


def _variant(model, dtype: str):
    t = VARIANTS[dtype]
    return t.apply(model, t.calibrate(model, None))


def measure_throughput(model, batch: int, prompt_len: int, new_tokens: int, repeats: int,
                       seed: int) -> dict:
    """Prefill and decode tokens/s at `batch`, medians after a warm-up run."""
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (batch, prompt_len)),
                         jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    max_len = prompt_len + new_tokens
    fresh = lambda: model.init_cache(batch, max_len)  # noqa: E731
    pre = time_fn(lambda: gen.prefill(model, tokens, lengths, fresh()), repeats=repeats)
    logits, states = gen.prefill(model, tokens, lengths, fresh())
    decode = lambda: gen.decode_loop(  # noqa: E731
        model, logits, lengths, states, jax.random.key(seed), max_new_tokens=new_tokens,
        sampling=gen.SamplingConfig(), stop_tokens=())
    dec = time_fn(decode, repeats=repeats)
    return {"prefill_tok_s": batch * prompt_len / pre["median_s"],
            "decode_tok_s": batch * (new_tokens - 1) / dec["median_s"],
            "prefill_s": pre["median_s"], "decode_s": dec["median_s"]}


def memory_rows(model, budget_gib: float, contexts) -> list[dict]:
    rows = []
    for dtype in VARIANTS:
        m = _variant(model, dtype)
        for ctx in contexts:
            rows.append({"kv_dtype": dtype, "context": ctx,
                         "kv_bytes_per_token": memory.kv_bytes_per_token(m, ctx),
                         f"max_batch@{budget_gib}GiB": memory.max_batch(
                             m, int(budget_gib * memory.GiB), ctx)})
    return rows


def run(config, out_dir) -> common.Report:
    del out_dir  # the runner writes the report; nothing else to save
    model, tok = load(config.gguf_path or None)
    ids = tok.encode(baseline_text(config))
    rows = []
    for dtype in VARIANTS:
        m = _variant(model, dtype)
        p = config.ppl
        ppl = perplexity(m, ids, window=p.window, stride=p.stride, batch_size=p.batch_size,
                         max_windows=p.max_windows or None, progress=True)
        row = {"dtype": dtype, "perplexity": ppl.ppl, "scored_tokens": ppl.n_tokens}
        if dtype in config.throughput.dtypes:
            for b in config.throughput.batches:
                t = measure_throughput(m, b, config.throughput.prompt_len,
                                       config.throughput.new_tokens,
                                       config.throughput.repeats, config.seed)
                row[f"prefill_tok/s@b{b}"] = t["prefill_tok_s"]
                row[f"decode_tok/s@b{b}"] = t["decode_tok_s"]
        row["kv_bytes/token"] = memory.kv_bytes_per_token(m, 4096)
        rows.append(row)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    mem = memory_rows(model, config.memory.budget_gib, config.memory.contexts)
    sample = gen.generate_text(model, tok, [config.sample.prompt],
                               max_new_tokens=config.sample.max_new_tokens)[0]
    gap = rows[1]["perplexity"] / rows[0]["perplexity"] - 1
    return common.Report(
        columns=columns, rows=rows, title="servax baseline: SmolLM2-135M-Instruct",
        claims=[common.claim("bf16 perplexity within 1% of f32", "<= 1%", f"{gap:+.2%}",
                             abs(gap) <= 0.01)],
        extra={"memory": mem, "sample_prompt": config.sample.prompt, "sample": sample,
               "held_out_tokens": len(ids)},
        notes=[f"held-out text: {len(ids)} tokens; throughput on {jax.default_backend()}, "
               "random prompt tokens, medians after warm-up",
               "KV memory (real cache array shapes): " + "; ".join(
                   f"{r['kv_dtype']} @ {r['context']}: {r['kv_bytes_per_token']:.0f} B/token,"
                   f" max batch {r[f'max_batch@{config.memory.budget_gib}GiB']}"
                   for r in mem),
               f"sample (greedy): {config.sample.prompt!r} -> {sample!r}"],
        plot=None)
