"""The KV codec frontier (see frontier.py for the command and what is measured)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.serving import long_context_quality_experiment as lcq
from experiments.serving.overhead_experiment import release_compiled

TECHNIQUE = "serving"
DEFAULTS_CHOSEN_ON = lcq.DEFAULTS_CHOSEN_ON
test_items = lcq.test_items  # the same windows and passkey prompts as the quality suite

COLUMNS = ["codec", "kv_bytes_per_token", "bytes_per_row", "kl", "top1", "ppl", "ref_ppl",
           "passkey_acc", "decode_tok_s", "decode_vs_bf16", "seqs_at_budget", "budget_tok_s",
           "budget_vs_bf16", "budget_modeled"]


SPEED_COLUMNS = ("bytes_per_row", "decode_tok_s", "step_ms", "seqs_at_budget",
                 "budget_rows_timed", "budget_step_ms", "budget_tok_s", "budget_modeled",
                 "compile_s", "compile_budget_s")  # speed()'s, None when not measured


def defaults(config) -> dict:
    return {k: config[k] for k in ("reference", "context", "continuation", "batch",
                                   "block_size", "budget_gib", "budget_probe_rows")}


def quality(model, served: dict, reference: str, windows, continuation: int) -> dict:
    """Per codec `Divergence` from `reference` over the windows' last `continuation`
    tokens, the rest of each window an exact prefix written into each codec's cache."""
    from research.eval import encoded_prefix as E
    from research.eval.divergence import logit_sums, summarize
    n_ctx = windows.shape[1] - continuation
    sums = {c: [] for c in served}
    for win in windows:
        win = win[None]
        t0 = time.perf_counter()
        prefix = E.exact_prefix(model, win[:, :n_ctx - 1])
        jax.block_until_ready(prefix.inputs)
        print(f"exact prefix {time.perf_counter() - t0:.0f}s", flush=True)
        logits = {}
        for codec in [reference] + [c for c in served if c != reference]:
            states = E.encoded_states(served[codec], prefix, win.shape[1])
            logits[codec], _ = E.run_tokens(served[codec], states, win[:, n_ctx - 1:-1],
                                            n_ctx - 1)
            sums[codec].append(np.stack([np.asarray(x, np.float64) for x in logit_sums(
                logits[reference], logits[codec], jnp.asarray(win[:, n_ctx:]))]))
            if codec != reference:
                del logits[codec]
        del prefix, logits
    release_compiled()
    return {c: summarize(np.concatenate(s, axis=1), continuation) for c, s in sums.items()}


def passkey(model, served: dict, tok, trials, tail: int, max_new_tokens: int) -> dict:
    """Per codec: per trial (answer, correct) of greedy decoding after each prompt, all
    but its last `tail` tokens an exact prefix written into the codec's cache."""
    from research.eval import encoded_prefix as E
    from research.eval.passkey import first_number
    max_len = max(len(t.ids) for t in trials) + max_new_tokens
    out = {c: [] for c in served}
    for trial in trials:
        ids = np.asarray(trial.ids, np.int32)[None]
        if ids.shape[1] <= tail:
            raise ValueError(f"passkey.tail={tail} must be shorter than the prompt "
                             f"({ids.shape[1]} tokens)")
        prefix = E.exact_prefix(model, ids[:, :-tail])
        for codec, m in served.items():
            states = E.encoded_states(m, prefix, max_len)
            gen = E.greedy_tokens(m, states, ids[:, -tail:], ids.shape[1] - tail,
                                  max_new_tokens)
            answer = first_number(tok.decode([int(t) for t in gen[0]], skip_special=True))
            out[codec].append({"depth": trial.depth, "key": trial.key, "answer": answer,
                               "correct": answer == trial.key})
        del prefix
        release_compiled()  # each trial's prefix length compiles its own programs
    return out


def speed(served: dict, config) -> dict:
    """Per codec: decode tok/s at `batch` rows and tok/s at the rows `budget_gib` holds
    (module docstring of frontier.py, (d) and (e))."""
    from experiments.serving.decode_step import decode_step, time_decode_steps
    from experiments.serving.long_context_experiment import bytes_per_row
    ctx, bs = config.context, config.block_size
    per_row = {c: bytes_per_row(m, ctx, bs) for c, m in served.items()}
    budget_rows = {c: int(config.budget_gib * 2**30 // b) for c, b in per_row.items()}
    probe = {c: max(1, min(r, config.budget_probe_rows)) for c, r in budget_rows.items()}
    # one set of caches at a time (each set: every codec's cache at 8k, GiBs)
    at_batch, first = time_decode_steps(
        {c: decode_step(m, config.batch, ctx, bs) for c, m in served.items()},
        config.decode_steps)
    release_compiled()
    at_probe, first_probe = time_decode_steps(
        {c: decode_step(m, probe[c], ctx, bs) for c, m in served.items()},
        config.decode_steps)
    release_compiled()
    out = {}
    for c in served:
        rows, p = budget_rows[c], probe[c]
        modeled = rows > p
        step = step_at_rows(rows, (config.batch, at_batch[c]), (p, at_probe[c]))
        out[c] = {"bytes_per_row": per_row[c], "decode_tok_s": config.batch / at_batch[c],
                  "step_ms": at_batch[c] * 1e3, "seqs_at_budget": rows,
                  "budget_rows_timed": p, "budget_step_ms": step * 1e3,
                  "budget_tok_s": rows / step if rows else 0.0, "budget_modeled": modeled,
                  "compile_s": first[c], "compile_budget_s": first_probe[c]}
    return out


def step_at_rows(rows: int, a: tuple[int, float], b: tuple[int, float]) -> float:
    """Step seconds at `rows`: measured at b's rows, or past them extrapolated along the
    line through the two measured (rows, seconds) points `a` and `b` (a line that falls,
    timing noise on steps too small to tell apart, extrapolates flat from b)."""
    (ra, ta), (rb, tb) = a, b
    if rows <= rb:
        return tb
    if rb <= ra:
        raise ValueError(f"extrapolating needs b's rows > a's, got {rb} <= {ra}")
    return tb + (rows - rb) * max(0.0, (tb - ta) / (rb - ra))


def run(config, out_dir) -> common.Report:
    del out_dir
    from experiments.serving.long_context_experiment import block_bytes
    from research.model import load
    from research.serving import kv_codecs
    if config.budget_probe_rows <= config.batch:
        raise ValueError(f"budget_probe_rows must exceed batch={config.batch}, got "
                         f"{config.budget_probe_rows}")
    model, tok = load(config.gguf_path or None)
    codecs = [common.kv_codec_name(c) for c in config.codecs]
    ref = common.kv_codec_name(config.reference)
    t0 = time.perf_counter()
    served = kv_codecs.served_models(model, tok, [ref] + codecs, seed=config.seed,
                                     calibration_seqs=config.calibration_seqs)
    timings = {"calibration_s": time.perf_counter() - t0}
    (wins, _, trials), = lcq.run_items(tok, config, model.config.max_position).values()
    t0 = time.perf_counter()
    div = quality(model, served, ref, wins, config.continuation)
    timings["quality_s"] = time.perf_counter() - t0
    print(timings, {c: round(d.kl, 5) for c, d in div.items()}, flush=True)
    t0 = time.perf_counter()
    pk = passkey(model, served, tok, trials, config.passkey.tail,
                 config.passkey.max_new_tokens) if trials else {}
    timings["passkey_s"] = time.perf_counter() - t0
    print(timings, flush=True)
    sp = {c: dict.fromkeys(SPEED_COLUMNS) for c in codecs}
    if config.measure_speed:
        t0 = time.perf_counter()
        sp = speed({c: served[c] for c in codecs}, config)
        timings["speed_s"] = time.perf_counter() - t0
    rows = []
    for c in codecs:
        d = div[c]
        row = {"codec": c, "kv_bytes_per_token": block_bytes(served[c], config.block_size)
               / config.block_size, "kl": d.kl, "top1": d.top1, "ppl": d.ppl,
               "ref_ppl": d.ref_ppl, "window_kl": d.window_kl,
               "passkey_acc": float(np.mean([t["correct"] for t in pk[c]])) if pk else None,
               "passkey_trials": len(pk.get(c, ())), **sp[c]}
        rows.append(row)
        print({k: row.get(k) for k in COLUMNS}, flush=True)
    base = next((r for r in rows if r["codec"] == "bf16"), None)
    timed = base is not None and config.measure_speed
    for r in rows:
        r["decode_vs_bf16"] = r["decode_tok_s"] / base["decode_tok_s"] if timed else None
        r["budget_vs_bf16"] = r["budget_tok_s"] / base["budget_tok_s"] if timed else None
    return common.Report(
        columns=COLUMNS, rows=rows, claims=_claims(rows, div[ref].ppl, config),
        notes=_notes(config, len(wins), len(trials)),
        extra={"timings": timings, "passkey_trials": pk},
        title=f"KV codec frontier at {config.context} tokens: bytes vs quality vs speed (CPU)",
        plot=lambda fig: _plot(fig, rows, config.measure_speed))


def _claims(rows, ref_ppl: float, config) -> list[dict]:
    by = {r["codec"]: r for r in rows}
    ctx = config.context
    out = []
    for c in ("tasq-1bit", "tasq-1bit+w128", "tasq-1bit-post", "tasq-1bit-post+w128"):
        if c not in by:
            continue
        r = by[c]
        rise = r["ppl"] / ref_ppl - 1
        out.append(common.claim(f"{c}: continuation ppl at {ctx} vs bf16 KV (exact prefix)",
                                "<= +15%", f"{rise:+.1%}", rise <= 0.15))
        if r["passkey_acc"] is not None and "bf16" in by:
            ok = r["passkey_acc"] >= 0.9 * by["bf16"]["passkey_acc"]
            out.append(common.claim(f"{c}: passkey accuracy at {ctx} vs bf16's",
                                    ">= 0.9x", f"{r['passkey_acc']:.2f} vs "
                                    f"{by['bf16']['passkey_acc']:.2f} "
                                    f"({r['passkey_trials']} trials)", ok))
        if r["decode_vs_bf16"] is not None:
            out.append(common.claim(f"{c}: decode tok/s at {config.batch} x {ctx} vs bf16",
                                    ">= 2x", f"{r['decode_vs_bf16']:.2f}x",
                                    r["decode_vs_bf16"] >= 2))
            out.append(common.claim(
                f"{c}: tok/s at an equal {config.budget_gib:g} GiB KV budget vs bf16",
                ">= 3x", f"{r['budget_vs_bf16']:.2f}x ({r['seqs_at_budget']} vs "
                f"{by['bf16']['seqs_at_budget']} rows"
                + (", modeled" if r["budget_modeled"] else "") + ")",
                r["budget_vs_bf16"] >= 3))
    for c in ("fp8", "int8"):
        if c in by:
            rise = by[c]["ppl"] / ref_ppl - 1
            out.append(common.claim(f"{c}: continuation ppl at {ctx} vs bf16 KV", "<= +1%",
                                    f"{rise:+.2%}", rise <= 0.01))
    return out


def _notes(config, n_windows: int, n_trials: int) -> list[str]:
    p = config.passkey
    return [
        f"{config.get('split', 'test')} split; quality: the last {config.continuation} tokens"
        f" of {n_windows} window(s) of {config.context} tokens, the rest computed once with "
        "exact attention and written into each codec's cache (research/eval/"
        "encoded_prefix.py; serving prefills through the codec in chunks, so its errors "
        "compound, these do not); kl = mean per-token KL(bf16 KV || codec), nats",
        f"passkey_acc: {n_trials} trial(s) of ~{config.context} tokens, all but the last "
        f"{p.tail} computed exactly, the tail and {p.max_new_tokens} greedy tokens read "
        "through the codec" if n_trials else "passkey: not run (passkey.trials=0)",
        f"decode_tok_s: the whole-model paged decode step (experiments/serving/"
        f"decode_step.py, the engine's step without its scheduler) at {config.batch} rows x "
        f"{config.context}, median of {config.decode_steps} calls interleaved across codecs;"
        f" budget_tok_s: rows = {config.budget_gib:g} GiB / bytes_per_row (codes + window "
        f"pages), timed at min(rows, {config.budget_probe_rows}); budget_modeled: the step "
        "at the budget's rows extrapolated linearly from the two measured row counts"
        if config.measure_speed else "speed: not measured (measure_speed=False)",
        "kv_bytes_per_token: the codec's paged block bytes / block size (real arrays); "
        "bytes_per_row adds the bf16 window pages an engine row holds"]


def _plot(fig, rows, with_speed: bool = True):
    panels = (("kl", "KL(bf16 KV || codec), nats", True),
              ("decode_tok_s", "decode tok/s, batch 4", False),
              ("budget_tok_s", "tok/s at 1 GiB of KV", False))[:3 if with_speed else 1]
    for i, (key, label, log) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for r in rows:
            y = max(r[key], 1e-5) if log else r[key]
            ax.scatter(r["kv_bytes_per_token"], y)
            ax.annotate(r["codec"], (r["kv_bytes_per_token"], y), fontsize=6)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("KV bytes per token")
        ax.set_ylabel(label)
