"""Long-context experiment (see long_context.py for the command and what is measured)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, protocol
from experiments.serving.overhead_experiment import release_compiled
from research import data
from research.model import load
from research.serving.api import Request, SamplingParams

TECHNIQUE = "serving"
DEFAULTS_CHOSEN_ON = ("none: a-priori engine settings; the codecs' own defaults were chosen "
                      "on their dev runs (TaSQ: tasq.py:dev); nothing is tuned here")

COLUMNS = ["context", "prompt_tokens", "codec", "decode_tok_s", "vs_bf16", "step_ms",
           "prefill_s", "kv_bytes_per_token", "bytes_per_row", "seqs_at_budget", "budget_tok_s",
           "budget_vs_bf16", "budget_step_ms", "cont_ppl"]


def defaults(config) -> dict:
    return {k: config[k] for k in ("batch", "block_size", "prefill_chunk", "min_read_len",
                                   "budget_gib")}


def quality_windows(tok, config) -> np.ndarray:
    """[n, length] windows of the fresh test text (research.data.stdlib_text) from token
    `quality.offset` on, laid end to end: the continuation-perplexity items."""
    q = config.quality
    ids = np.asarray(tok.encode(data.split_text("test", "stdlib")), np.int32)
    end = q.offset + q.windows * q.length
    if end > len(ids):
        raise ValueError(f"quality windows need tokens up to {end}, the text has {len(ids)}")
    return ids[q.offset:end].reshape(q.windows, q.length)


def test_items(config) -> list:
    """The quality windows this run scores; a speed-only run (quality.windows 0, as the
    runs before issue 34's quality column) scores no text and declares its run item
    (keyed by its config's fingerprint), so at least its reruns are counted."""
    if not config.get("quality") or not config.quality.windows:
        return [protocol.run_item(TECHNIQUE, config)]
    tok = common.tokenizer_only(config.gguf_path or None)
    q = config.quality
    return [protocol.window_item(w, f"fresh stdlib-docstring test text tokens "
                                    f"[{q.offset + i * q.length}, "
                                    f"{q.offset + (i + 1) * q.length})")
            for i, w in enumerate(quality_windows(tok, config))]


def served_model(model, tok, codec: str, config):
    """`model` with the registered KV codec `codec` (research/serving/kv_codecs.py, the
    server's names; the committed runs' "tasq-1bit-post-rope" is tasq-1bit-post:
    common.LEGACY_KV_CODECS), calibrated ones on config.calibration_seqs x 256 tokens of
    the calibration split."""
    from research.serving import kv_codecs
    return kv_codecs.served_model(model, tok, common.kv_codec_name(codec), seed=config.seed,
                                  calibration_seqs=config.calibration_seqs)


def block_bytes(served, block_size: int) -> int:
    """Bytes of one KV block of `served`'s codec in the engine's pool (real arrays; a
    windowed codec's codes, its bf16 copies being in window pages: `window_page_bytes`)."""
    return _one_block_pool(served, block_size).block_bytes


def window_page_bytes(served, block_size: int) -> int:
    """Bytes of one window page of a windowed codec's bf16 copies (0 without a window)."""
    return _one_block_pool(served, block_size).window_bytes


def _one_block_pool(served, block_size: int):
    from research.decode.paged_pool import PagedPool
    return PagedPool(served, n_blocks=1, block_size=block_size, max_len=block_size,
                     window_blocks=1)


def bytes_per_row(served, context: int, block_size: int) -> int:
    """KV bytes an engine holds per decode row at `context`: the row's blocks of codes
    plus, for a windowed codec, the window pages the engine allocates per row
    (ServingEngine sizes its window pool for 2 x max_batch rows: window_pages_for)."""
    from research.serving.engine import window_pages_for
    pages = window_pages_for(served, block_size, 2)
    return (-(-context // block_size) * block_bytes(served, block_size)
            + pages * window_page_bytes(served, block_size))


def rows_of_one_prompt(served, tok, prompt, rows: int, config):
    """An engine whose `rows` decode slots each hold a private copy of `prompt`'s KV: the
    prompt is prefilled once (chunked) and `ServingEngine.fork` copies its blocks and
    next token into the other rows (no forward), so no two rows read the same page.
    Returns (engine, prefill seconds of the first row)."""
    from research.serving.engine import ServingEngine
    bs = config.block_size
    max_len = len(prompt) + config.decode_steps + 1
    per_seq = -(-max_len // bs)
    engine = ServingEngine(
        served, tok, n_blocks=rows * (per_seq + 1) + 1, block_size=bs, max_batch=rows,
        max_len=max_len, token_budget=config.prefill_chunk,
        prefill_chunk=config.prefill_chunk, max_prefill_rows=1, prefix_cache=False,
        min_read_len=config.min_read_len, max_queue=rows, stop_token_ids=())
    t0 = time.perf_counter()
    engine.insert(engine.prefill(Request("r0", tuple(prompt), SamplingParams(
        max_new_tokens=config.decode_steps + 1))), 0)
    prefill_s = time.perf_counter() - t0
    for slot in range(1, rows):
        engine.insert(engine.fork("r0", f"r{slot}"), slot)
    return engine, prefill_s


def time_decode(engine, rows: int, steps: int) -> float:
    """Median seconds of a decode step of all `rows` (all but the first step)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        _, toks = engine.generate(engine.state)
        times.append(time.perf_counter() - t)
        assert sum(len(x) == 1 for x in toks) == rows, toks  # every row decoded one token
    return float(np.median(times[1:]))


def decode_speed(served, tok, prompt, rows: int, steps: int, config) -> dict:
    """Decode tok/s of `rows` rows, each a private copy of one prefilled `prompt`."""
    engine, prefill_s = rows_of_one_prompt(served, tok, prompt, rows, config)
    step = time_decode(engine, rows, steps)
    out = {"tok_s": rows / step, "step_ms": step * 1e3, "prefill_s": prefill_s,
           "compiles_while_serving": engine.metrics().compiles}
    del engine
    release_compiled()
    return out


def prefill_memory(model, batch: int, context: int, chunk: int) -> dict:
    """Bytes XLA plans (arguments + temporaries) for one generate prefill of
    batch x context tokens in one piece and in `chunk`-token pieces (bf16 cache)."""
    from research.decode import generate as G
    from research.serving import kv_codecs
    m = kv_codecs.codec_model(model, "bf16")
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


def codec_rows(model, tok, codec: str, ids, config) -> list[dict]:
    """Per context: decode tok/s at `batch` rows and at the rows `budget_gib` of this
    codec's pool holds, every row a private copy of one prefilled prompt."""
    served = served_model(model, tok, codec, config)
    bb = block_bytes(served, config.block_size)
    out = []
    for context in config.contexts:
        # a prompt and its decoded tokens must fit the model's positions: at the trained
        # length (8192) the prompt is context - decode_steps - 1 tokens
        n = min(context, model.config.max_position - config.decode_steps - 1)
        prompt = ids[:n]
        per_seq_bytes = bytes_per_row(served, context, config.block_size)
        budget_rows = int(config.budget_gib * 2**30 // per_seq_bytes)
        if config.max_budget_rows:
            budget_rows = min(budget_rows, config.max_budget_rows)
        at_batch = decode_speed(served, tok, prompt, config.batch, config.decode_steps,
                                config)
        at_budget = (decode_speed(served, tok, prompt, budget_rows,
                                  config.budget_decode_steps, config)
                     if budget_rows else {"tok_s": 0.0, "step_ms": float("nan")})
        row = {"context": context, "prompt_tokens": n, "codec": codec,
               "decode_tok_s": at_batch["tok_s"], "step_ms": at_batch["step_ms"],
               "prefill_s": at_batch["prefill_s"], "kv_bytes_per_token": bb / config.block_size,
               "bytes_per_row": per_seq_bytes, "seqs_at_budget": budget_rows, "budget_tok_s": at_budget["tok_s"],
               "budget_step_ms": at_budget["step_ms"],
               "compiles_while_serving": at_batch["compiles_while_serving"]
               + at_budget.get("compiles_while_serving", 0)}
        print(row, flush=True)
        out.append(row)
    if config.quality.windows:
        from research.eval.perplexity import continuation_perplexity
        q = config.quality
        ppl = continuation_perplexity(served, quality_windows(tok, config),
                                      q.length - q.continuation, batch_size=q.batch,
                                      chunk=config.prefill_chunk)
        for row in out:
            row["cont_ppl"], row["cont_tokens"] = ppl.ppl, ppl.n_tokens
        print(codec, "continuation ppl", ppl, flush=True)
    del served
    release_compiled()
    return out


def run(config, out_dir) -> common.Report:
    del out_dir
    model, tok = load(config.gguf_path or None)
    ids = tok.encode(data.corpus_text(config.text_split))
    longest = min(max(config.contexts), model.config.max_position)
    if len(ids) < longest:
        raise ValueError(f"the {config.text_split} text has {len(ids)} tokens, fewer than "
                         f"the longest context {longest}")
    rows = [r for codec in config.codecs for r in codec_rows(model, tok, codec, ids, config)]
    for row in rows:
        ref = next(r for r in rows if r["context"] == row["context"] and r["codec"] == "bf16")
        row["vs_bf16"] = row["decode_tok_s"] / ref["decode_tok_s"]
        row["seqs_vs_bf16"] = row["seqs_at_budget"] / max(1, ref["seqs_at_budget"])
        row["budget_vs_bf16"] = row["budget_tok_s"] / ref["budget_tok_s"]
    extra = {"prefill_memory": prefill_memory(model, config.memory_batch,
                                              config.memory_context, config.prefill_chunk)}
    print(extra, flush=True)
    tasq_rows = [r for r in rows if r["codec"].startswith("tasq")]
    claims = [common.claim(f"TaSQ 1-bit ({r['codec']}) / bf16 decode tok/s at {config.batch} "
                           f"x {r['context']}", ">= 2x", f"{r['vs_bf16']:.2f}x",
                           r["vs_bf16"] >= 2) for r in tasq_rows]
    claims += [common.claim(f"TaSQ 1-bit ({r['codec']}) / bf16 engine output tok/s at an "
                            f"equal {config.budget_gib:g} GiB KV budget, {r['context']} "
                            "tokens", ">= 3x",
                            f"{r['budget_vs_bf16']:.2f}x ({r['seqs_at_budget']} vs "
                            f"{r['seqs_at_budget'] / r['seqs_vs_bf16']:.0f} sequences)",
                            r["budget_vs_bf16"] >= 3)
               for r in tasq_rows if r["context"] == max(config.contexts)]
    mem = extra["prefill_memory"]
    q = config.quality
    notes = [f"every row of a measurement is a private copy of one prefilled prompt of "
             f"consecutive {config.text_split}-split tokens (`ServingEngine.fork`: private "
             "copies of its pages, no two rows read the same page; decode cost does not "
             "depend on the values); prefill_s: that one prompt through the "
             f"engine in {config.prefill_chunk}-token chunks; reads bucketed from "
             f"{config.min_read_len} tokens",
             f"decode_tok_s: batch {config.batch}, {config.decode_steps} decode steps (median "
             f"of all but the first); budget_tok_s: engine output tok/s with seqs_at_budget "
             f"rows = {config.budget_gib} GiB / bytes_per_row (blocks of a context-length "
             "sequence x the pool's measured block bytes, plus for a windowed codec the "
             "bf16 window pages the engine allocates per row, measured page bytes), "
             f"{config.budget_decode_steps} steps"
             + (f", capped at {config.max_budget_rows} rows" if config.max_budget_rows else ""),
             f"generate prefill of {config.memory_batch} x {config.memory_context} (f32 "
             f"weights, bf16 cache), XLA-planned bytes: one piece "
             f"{mem['one_piece_bytes'] / 2**30:.1f} GiB, 512-token pieces "
             f"{mem['chunked_bytes'] / 2**30:.2f} GiB"]
    if q.windows:
        notes.append(
            f"cont_ppl: perplexity of the last {q.continuation} tokens of {q.windows} "
            f"window(s) of {q.length} tokens of the fresh test text (research.data."
            f"stdlib_text, tokens from {q.offset}; test split, scored once: no setting "
            "here was chosen on it), the first "
            f"{q.length - q.continuation} prefilled through the codec's dense cache")
    return common.Report(columns=COLUMNS, rows=rows, claims=claims, notes=notes, extra=extra,
                         title="Long-context decode by KV codec through the engine (CPU)",
                         plot=lambda fig: _plot(fig, rows, config))


def _plot(fig, rows, config):
    n = len(config.contexts)
    for i, context in enumerate(config.contexts):
        sub = [r for r in rows if r["context"] == context]
        labels = [r["codec"].replace("-", "\n", 1) for r in sub]
        for j, (key, title) in enumerate((
                ("decode_tok_s", f"{config.batch} x {context} tokens"),
                ("budget_tok_s", f"{config.budget_gib:g} GiB of KV, {context} tokens"))):
            ax = fig.add_subplot(2, n, j * n + i + 1)
            ax.bar(range(len(sub)), [r[key] for r in sub])
            ax.set_xticks(range(len(sub)), labels)
            ax.set_title(title)
            ax.set_ylabel("decode tok/s" if j == 0 else "engine output tok/s")
