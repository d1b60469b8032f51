"""Engine overhead experiment (see overhead.py for the command and what is measured)."""
from __future__ import annotations

import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from research.model import load
from research.decode import generate as G
from research.serving.api import Request, SamplingParams

TECHNIQUE = "serving"
DEFAULTS_CHOSEN_ON = "none: random-token prompts and engine sizes set a priori, not tuned"

COLUMNS = ["codec", "batch", "generate_tok_s", "engine_tok_s", "engine_over_generate",
           "generate_compile_s", "engine_compile_s", "engine_2x_max_len_tok_s", "step_ms",
           "step_2x_max_len_ms", "forward_share", "detokenize_share", "host_share",
           "load_1min"]


def defaults(config) -> dict:
    return {k: config[k] for k in ("prompt_tokens", "new_tokens", "max_len", "block_size",
                                   "prefill_chunk")}


def _generate_run(model, prompts, new_tokens) -> dict:
    """One batch through `generate`: wall seconds of prefill + `decode_loop` ("wall_s")
    and of `decode_loop` alone ("decode_s")."""
    w0 = time.perf_counter()
    tokens, lengths = G.pad_prompts(prompts, model.config.vocab_size)
    states = model.init_cache(len(prompts), tokens.shape[1] + new_tokens)
    logits, states = G.prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), states)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    out = G.decode_loop(model, logits, jnp.asarray(lengths), states, jax.random.key(0),
                        max_new_tokens=new_tokens, sampling=G.SamplingConfig(),
                        stop_tokens=())
    jax.block_until_ready(out.tokens)
    t1 = time.perf_counter()
    return {"wall_s": t1 - w0, "decode_s": t1 - t0}


def _engine_run(engine, prompts, new_tokens, tag) -> dict:
    """One batch of requests through `engine.step()`: the wall seconds of its pure-decode
    steps (every row decoding, no prefill token in the step: the work `decode_loop` does)
    and the step-time breakdown over the whole run."""
    from research.serving.engine import StepStats
    engine.step_stats = StepStats()
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{tag}-{i}", tuple(p), SamplingParams(
            max_new_tokens=new_tokens, temperature=0.0)))
    decode_steps = []
    w0 = time.perf_counter()
    while engine.has_work():
        before = engine.step_stats.prefill_tokens
        t0 = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - t0
        if engine.step_stats.prefill_tokens == before and sum(
                e.token_id is not None for e in events) == len(prompts):
            decode_steps.append(dt)
    wall_s = time.perf_counter() - w0
    st = engine.step_stats
    return {"wall_s": wall_s, "decode_s": float(np.sum(decode_steps)),
            "decode_steps": len(decode_steps), "step_s": float(np.median(decode_steps)), "forward": st.forward_s / st.step_s,
            "detokenize": st.detokenize_s / st.step_s, "host": st.host_s / st.step_s}


def _timed_setting(served, engines, prompts, new_tokens, rounds) -> dict:
    """Both sides warmed, then timed in `rounds` interleaved rounds.

    The first call of each side (generate's prefill + decode_loop, each engine's whole
    batch) compiles its programs and is not timed into the comparison: its excess over
    the warm median is reported as that side's compile seconds. Each timed round then
    measures the same work on both sides: b rows x (new_tokens - 1) decode steps after
    the prefill (the first token comes from the prefill's logits in both).
    """
    b = len(prompts)
    gen_first = _generate_run(served, prompts, new_tokens)
    eng_first = [_engine_run(e, prompts, new_tokens, f"warm{i}") for i, e in enumerate(engines)]
    gen, eng, eng2 = [], [], []
    for r in range(rounds):
        gen.append(_generate_run(served, prompts, new_tokens))
        eng.append(_engine_run(engines[0], prompts, new_tokens, f"a{r}"))
        eng2.append(_engine_run(engines[1], prompts, new_tokens, f"b{r}"))
    gen_rounds = [b * (new_tokens - 1) / g["decode_s"] for g in gen]
    eng_rounds = [b * e["decode_steps"] / e["decode_s"] for e in eng]
    gen_tok_s, eng_tok_s = float(np.median(gen_rounds)), float(np.median(eng_rounds))
    step = float(np.median([e["step_s"] for e in eng]))
    step2 = float(np.median([e["step_s"] for e in eng2]))

    def compile_s(first, warm):  # the first whole batch's excess over a warm one
        return max(first["wall_s"] - float(np.median([w["wall_s"] for w in warm])), 0.0)
    row = {"generate_tok_s": gen_tok_s, "engine_tok_s": eng_tok_s,
           "engine_over_generate": eng_tok_s / gen_tok_s,
           "engine_2x_max_len_tok_s": b / step2, "step_ms": step * 1e3,
           "step_2x_max_len_ms": step2 * 1e3,
           "generate_compile_s": compile_s(gen_first, gen),
           "engine_compile_s": compile_s(eng_first[0], eng),
           "generate_tok_s_rounds": gen_rounds, "engine_tok_s_rounds": eng_rounds}
    for k in ("forward", "detokenize", "host"):
        row[f"{k}_share"] = float(np.median([e[k] for e in eng]))
    return row


def release_compiled() -> None:
    """Drop compiled programs and dead engines: every engine compiles a dozen programs, and
    XLA:CPU ran out of executable memory ("LLVM compilation error: Cannot allocate
    memory") after five codec x batch settings in one process."""
    gc.collect()
    jax.clear_caches()


def _median_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def sampling_profile(vocab: int, batch: int, reps: int) -> list[dict]:
    """The engine's sampler on [batch, vocab] logits: all greedy, half the rows sampled
    (top-p 0.9), and the full-vocabulary sort it replaced (the reference filter + draw)."""
    from research.decode.sampling import filter_logits_per_row, sample_per_row
    logits = jax.random.normal(jax.random.key(0), (batch, vocab)) * 3
    keys = jnp.zeros((batch, 2), jnp.uint32)
    hot = jnp.arange(batch) % 2 == 0
    settings = {"all greedy": (jnp.zeros(batch), jnp.ones(batch)),
                "half sampled (T 0.8, top-p 0.9)": (jnp.where(hot, 0.8, 0.0),
                                                     jnp.full(batch, 0.9))}
    fn = jax.jit(sample_per_row)
    rows = [{"what": f"sample_per_row, {name}", "ms": _median_ms(
        lambda t=t, p=p: fn(logits, t, jnp.zeros(batch, jnp.int32), p, keys), reps)}
        for name, (t, p) in settings.items()]

    @jax.jit
    def full_sort(logits, t, p):
        filtered = filter_logits_per_row(logits, t, jnp.zeros(batch, jnp.int32), p)
        return jax.vmap(jax.random.categorical)(jax.random.wrap_key_data(keys), filtered)
    rows.append({"what": "full-vocabulary sort + draw (the sampler before)", "ms": _median_ms(
        lambda: full_sort(logits, jnp.full(batch, 0.8), jnp.full(batch, 0.9)), reps)})
    return rows


def pool_size_profile(served, batch: int, config, reps: int) -> list[dict]:
    """One decode forward of the engine (`serve_forward`, bf16 pages) as the pool grows at
    the same live rows: flat when pages are updated in place."""
    from research.serving.engine import serve_forward
    from research.decode.paged_pool import PagedPool
    rows = []
    per_seq = -(-config.max_len // config.block_size)
    live = -(-(config.prompt_tokens + 1) // config.block_size)
    for factor in (1, 4, 16):
        pool = PagedPool(served, n_blocks=factor * batch * per_seq, block_size=config.block_size,
                         max_len=config.max_len)
        table = np.arange(batch * live, dtype=np.int32).reshape(batch, live)
        i32 = np.zeros(batch, np.int32)
        args = (np.zeros((batch, 1), np.int32), np.full(batch, config.prompt_tokens, np.int32),
                np.ones(batch, np.int32), np.zeros(batch, np.float32), i32,
                np.ones(batch, np.float32), np.zeros((batch, 2), np.uint32))

        def step():
            pool.pools, sampled, _ = serve_forward(pool.model, pool.pools, table, *args,
                                                   verify=False)
            return sampled
        rows.append({"what": f"decode forward, batch {batch}, {pool.n_blocks} blocks "
                             f"({pool.n_blocks * pool.block_bytes / 2**20:.0f} MiB of pages)",
                     "ms": _median_ms(step, reps)})
        pool = step = None  # frees this pool's pages before the next, larger one
    return rows


def run(config, out_dir) -> common.Report:
    del out_dir
    from research.serving.engine import ServingEngine
    from research.serving.server import kv_codec_model
    model, tok = load(config.gguf_path or None)
    rng = np.random.default_rng(config.seed)
    rows = []
    for codec in config.codecs:
        served = kv_codec_model(model, tok, codec, seed=config.seed,
                                calibration_seqs=config.calibration_seqs)
        for b in config.batches:
            prompts = [rng.integers(100, model.config.vocab_size - 100,
                                    config.prompt_tokens).tolist() for _ in range(b)]
            need = -(-(config.prompt_tokens + config.new_tokens) // config.block_size)
            engines = [ServingEngine(
                served, tok, n_blocks=b * need + 2 * -(-max_len // config.block_size),
                block_size=config.block_size, max_batch=b, max_len=max_len,
                token_budget=max(b, config.prefill_chunk * 2),
                prefill_chunk=config.prefill_chunk, prefix_cache=False, max_queue=b,
                stop_token_ids=())  # as generate: every row decodes new_tokens
                for max_len in (config.max_len, 2 * config.max_len)]
            row = {"codec": codec, "batch": b,
                   **_timed_setting(served, engines, prompts, config.new_tokens,
                                    config.rounds),
                   "load_1min": round(os.getloadavg()[0], 2)}
            print(row, flush=True)
            rows.append(row)
            del engines
            release_compiled()
    from research.serving import kv_codecs
    profile = sampling_profile(model.config.vocab_size, max(config.batches), config.profile_reps)
    profile += pool_size_profile(kv_codecs.codec_model(model, "bf16"),
                                 min(config.batches), config, config.profile_reps)
    for row in profile:
        print(row, flush=True)
    claims = [{"claim": f"engine / generate decode tok/s, {r['codec']} batch {r['batch']}",
               "target": ">= 0.8", "measured": r["engine_over_generate"],
               "met": r["engine_over_generate"] >= 0.8} for r in rows]
    claims += [{"claim": f"decode step at 2x max_len / at max_len, {r['codec']} batch "
                         f"{r['batch']}", "target": "< 1.1",
                "measured": r["step_2x_max_len_ms"] / r["step_ms"],
                "met": r["step_2x_max_len_ms"] / r["step_ms"] < 1.1} for r in rows]
    notes = [f"{config.prompt_tokens}-token random prompts, {config.new_tokens} greedy tokens, "
             f"both sides warmed by one untimed batch, then {config.rounds} interleaved "
             "rounds, medians; tok/s = rows x decode steps / their wall seconds on both "
             "sides (prefill outside; compile seconds = the first batch's excess over a "
             f"warm one, in their own columns); engine max_len {config.max_len} "
             f"(and {2 * config.max_len}), prefix cache off; generate's cache holds exactly "
             "prompt + new tokens",
             "load_1min: the machine's 1-minute load average after the setting (2 cores: "
             "above ~1, other processes shared the CPU; rounds are interleaved so both "
             "sides saw it alike)",
             "shares: of the engine's step() wall time over a whole run (prefill steps "
             "included): forward calls (device + waiting for tokens), detokenization, host "
             "scheduling"]
    tables = [{"title": "Where a step's time went: the sampler and the pool-size scaling "
                        "(medians, ms)", "columns": ["what", "ms"], "rows": profile}]
    return common.Report(columns=COLUMNS, rows=rows, claims=claims, notes=notes, tables=tables,
                         extra={"profile": profile},
                         title="Engine decode vs generate.decode_loop (CPU)",
                         plot=lambda fig: _plot(fig, rows))


def _plot(fig, rows):
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{r['codec']}\nb{r['batch']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["generate_tok_s"] for r in rows], 0.4, label="generate.decode_loop")
    ax.bar(x + 0.2, [r["engine_tok_s"] for r in rows], 0.4, label="ServingEngine")
    ax.set_xticks(x, labels)
    ax.set_ylabel("decode tok/s")
    ax.legend()
