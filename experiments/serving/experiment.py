"""servax serve experiment (see serving.py for the command and sections)."""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from experiments import common, protocol
from experiments.serving import loadgen as lg
from research import data
from research.model import load
from research.decode.generate import default_stop_tokens

MODEL_NAME = "SmolLM2-135M-Instruct"
# dev/test protocol declarations (experiments/protocol.py where it exists): nothing here
# is tuned; engine sizes and SLOs were set a priori for a 2-core CPU
TECHNIQUE = "serving"
# the item ledger counts this run's test text as a workload, not as scored items:
# throughput and latency: the prompts' text matters only through its lengths
TEST_ITEMS_USE = "load"
DEFAULTS_CHOSEN_ON = "none: engine sizes and SLOs set a priori for a 2-core CPU, not tuned"


def defaults(config) -> dict:
    return {"engine": config.engine.to_dict(), "slo": config.slo.to_dict()}


def test_items(config) -> list:
    """The workload's text (prompts are its paragraphs, drawn at random): the whole of
    `config.workload.split` as windows of 256 tokens (the item ledger,
    experiments/protocol.py; speed only, no quality is scored)."""
    tok = common.tokenizer_only(config.get("gguf_path", "") or None)
    split = config.workload.split
    return protocol.tiled_windows(tok.encode(data.corpus_text(split)), 256,
                                  f"pydoc {split}")


COLUMNS = ["section", "variant", "rate", "ok", "out_tok_s", "goodput_req_s", "ttft_p50_ms",
           "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms", "peak_running",
           "hit_rate", "predicted_hit_rate"]


def _engine(model, tok, config, **overrides):
    from research.serving.server import build_engine
    kw = dict(config.engine.to_dict())
    kw.update(overrides)
    return build_engine(model, tok, seed=config.seed, **kw)


def _row(section, variant, rate, summary, **extra):
    return {"section": section, "variant": variant, "rate": rate, **summary, **extra}


def _workload(tok, config, n, rate, seed):
    w = config.workload
    return lg.sharegpt_like(tok, n, rate, seed, split=w.split, prompt_median=w.prompt_median,
                            prompt_sigma=w.prompt_sigma, output_median=w.output_median,
                            output_sigma=w.output_sigma, max_prompt=w.max_prompt,
                            max_output=w.max_output, burstiness=w.burstiness)


def _summ(config, results, wall):
    return lg.summarize(results, wall, ttft_slo_s=config.slo.ttft_s, tpot_slo_s=config.slo.tpot_s)


def _peak(samples) -> int:
    return max((r for _, r, _ in samples), default=0)


# --------------------------------------------------------------------------- sections


def sweep(engine, tok, config) -> list[dict]:
    """Rate sweep over HTTP: the real server (uvicorn in a thread) on `engine`."""
    from research.serving.engine_loop import EngineLoop
    from research.serving.server import ServerThread, create_app
    from research.serving.state import ServerConfig
    loop = EngineLoop(engine).start()
    app = create_app(loop, tok, ServerConfig(model_name=MODEL_NAME,
                                             max_context=config.engine.max_len))
    rows = []
    try:
        with ServerThread(app) as srv:
            warm = _workload(tok, config, 2, math.inf, config.seed + 999)
            lg.run_http(srv.url, MODEL_NAME, warm)
            for k, rate in enumerate(config.sweep.rates):
                specs = _workload(tok, config, config.sweep.n_requests, rate, config.seed + k)
                results, wall = lg.run_http(srv.url, MODEL_NAME, specs)
                s = _summ(config, results, wall)
                print(f"sweep rate={rate}: {s['out_tok_s']:.1f} tok/s, ttft p50 "
                      f"{s['ttft_p50_ms']:.0f} ms p99 {s['ttft_p99_ms']:.0f} ms", flush=True)
                rows.append(_row("sweep", "servax HTTP", rate, s))
    finally:
        loop.stop()
    return rows


def batching(engine, tok, config) -> list[dict]:
    specs = _workload(tok, config, config.batching.n_requests, config.batching.rate,
                      config.seed + 100)
    rows = []
    for policy in ("continuous", "static"):
        results, wall, samples = lg.run_engine(engine, tok, specs, policy=policy,
                                               static_batch=config.engine.max_batch)
        s = _summ(config, results, wall)
        print(f"batching {policy}: {s['out_tok_s']:.1f} tok/s, ttft p99 "
              f"{s['ttft_p99_ms']:.0f} ms", flush=True)
        rows.append(_row("batching", policy, config.batching.rate, s,
                         peak_running=_peak(samples)))
    return rows


def tasq_vs_bf16(model, tok, config) -> tuple[list[dict], dict]:
    """Same KV-pool bytes for both codecs; all requests arrive at t=0; max_batch is large
    so the pool, not the slot count, limits concurrency."""
    from research.serving.engine import ServingEngine
    from research.serving.server import kv_codec_model
    t = config.tasq
    e = config.engine
    served = {"bf16": kv_codec_model(model, tok, "bf16"),
              "tasq-1bit": kv_codec_model(model, tok, "tasq-1bit", seed=config.seed,
                                          calibration_seqs=t.calibration_seqs)}
    min_blocks = -(-e.max_len // e.block_size) + 1  # one max_len request + a copy-on-write block
    block_bytes = {k: ServingEngine(m, tok, n_blocks=min_blocks, block_size=e.block_size,
                                    max_batch=1, max_len=e.max_len, token_budget=e.token_budget,
                                    warmup=False).pool.block_bytes
                   for k, m in served.items()}
    budget = t.budget_bf16_blocks * block_bytes["bf16"]
    specs = _workload(tok, config, t.n_requests, math.inf, config.seed + 200)
    specs = [dataclasses.replace(s, prompt=_cut(tok, s.prompt, t.prompt_tokens),
                                 max_tokens=t.max_tokens) for s in specs]
    rows, info = [], {"budget_bytes": budget, "block_bytes": block_bytes}
    for name, m in served.items():
        n_blocks = budget // block_bytes[name]
        engine = ServingEngine(m, tok, n_blocks=n_blocks, block_size=e.block_size,
                               max_batch=t.max_batch, max_len=e.max_len,
                               token_budget=max(e.token_budget, t.max_batch),
                               prefill_chunk=e.prefill_chunk, max_queue=e.max_queue,
                               prefix_cache=False)
        results, wall, samples = lg.run_engine(engine, tok, specs)
        s = _summ(config, results, wall)
        per_seq = -(-(t.prompt_tokens + t.max_tokens) // e.block_size)
        info[name] = {"n_blocks": int(n_blocks), "peak_running": _peak(samples),
                      "pool_capacity_seqs": int(n_blocks // per_seq),
                      "preemptions": engine.metrics().preemptions,
                      "out_tok_s": s["out_tok_s"],
                      "tokens_per_sequence": t.prompt_tokens + t.max_tokens}
        print(f"tasq {name}: {n_blocks} blocks, peak {_peak(samples)} seqs, "
              f"{s['out_tok_s']:.1f} tok/s", flush=True)
        rows.append(_row("tasq", f"{name} ({n_blocks} blocks)", "all at t=0", s,
                         peak_running=_peak(samples)))
        del engine
    return rows, info


def _cut(tok, text, n_tokens):
    return tok.decode(tok.encode(text)[:n_tokens], skip_special=True)


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix(model, tok, engine_on, config) -> tuple[list[dict], dict]:
    """Shared-prefix groups through the engine with the prefix cache on and off."""
    p = config.prefix
    bs = config.engine.block_size
    engine_off = _engine(model, tok, config, prefix_cache=False)
    rows, info = [], {}
    for g in p.group_sizes:
        specs = lg.shared_prefix(tok, max(1, p.n_requests // g), g, p.rate, config.seed + g,
                                 prefix_tokens=p.prefix_tokens, suffix_tokens=p.suffix_tokens,
                                 max_tokens=p.max_tokens, split=config.workload.split)
        ids = [tok.encode(s.prompt) for s in specs]
        # predicted hit rate k*r/(k+1): k = g - 1 followers per group, r = the share of a
        # prompt that its group shares (token LCP), and the block-rounded r the cache can hit
        shared = {}
        for s, x in zip(specs, ids):
            shared.setdefault(s.group, []).append(x)
        r_tok, r_blk = [], []
        for members in shared.values():
            lcp = min(_lcp(members[0], m) for m in members[1:]) if len(members) > 1 else 0
            for m in members:
                r_tok.append(lcp / len(m))
                r_blk.append(min(lcp, len(m) - 1) // bs * bs / len(m))
        k = g - 1
        pred = k * float(np.mean(r_tok)) / (k + 1)
        pred_blk = k * float(np.mean(r_blk)) / (k + 1)
        for name, engine in (("cache on", engine_on), ("cache off", engine_off)):
            if engine.pool.prefix_cache is not None:
                engine.pool.prefix_cache.clear()  # every group size starts cold
            m0 = engine.metrics()
            results, wall, _ = lg.run_engine(engine, tok, specs)
            m1 = engine.metrics()
            q = m1.prefix_cache_queries - m0.prefix_cache_queries
            hit = (m1.prefix_cache_hits - m0.prefix_cache_hits) / q if q else 0.0
            n_prompt = sum(r.n_prompt for r in results if r.ok)
            n_cached = sum(r.n_cached for r in results if r.ok)
            cached_frac = n_cached / n_prompt if n_prompt else 0.0
            costs = {f"cost_per_m_at_{f}x": p.price_per_m * ((1 - cached_frac) + f * cached_frac)
                     for f in p.cached_price_factors}
            s = _summ(config, results, wall)
            info[f"group {g} {name}"] = {"hit_rate_engine": hit, "cached_fraction": cached_frac,
                                         "predicted": pred, "predicted_block_rounded": pred_blk,
                                         **costs}
            print(f"prefix g={g} {name}: hit {hit:.3f} (pred {pred:.3f}, block-rounded "
                  f"{pred_blk:.3f}), ttft p50 {s['ttft_p50_ms']:.0f} ms", flush=True)
            rows.append(_row("prefix", f"group of {g}, {name}", p.rate, s,
                             hit_rate=cached_frac, predicted_hit_rate=pred_blk))
    return rows, info


def spec(model, tok, engine_off, config) -> tuple[list[dict], dict]:
    c = config.spec
    engine_on = _engine(model, tok, config, speculative=c.draft_tokens)
    loads = {
        "repetitive": lg.repetitive(tok, c.n_requests, c.rate, config.seed + 300,
                                    passage_tokens=c.passage_tokens, max_tokens=c.max_tokens,
                                    split=config.workload.split),
        "free-form": [dataclasses.replace(s, max_tokens=c.max_tokens) for s in
                      _workload(tok, config, c.n_requests, c.rate, config.seed + 301)],
    }
    rows, info = [], {}
    for load_name, specs in loads.items():
        tokens = {}
        for name, engine in (("spec off", engine_off), (f"spec k={c.draft_tokens}", engine_on)):
            st0 = dataclasses.replace(engine.spec_stats)
            results, wall, _ = lg.run_engine(engine, tok, specs)
            st1 = engine.spec_stats
            drafted = st1.drafted - st0.drafted
            accepted = st1.accepted - st0.accepted
            tokens[name] = [r.n_output for r in results]
            s = _summ(config, results, wall)
            info[f"{load_name} {name}"] = {"drafted": drafted, "accepted": accepted,
                                           "acceptance": accepted / drafted if drafted else None,
                                           "out_tok_s": s["out_tok_s"]}
            print(f"spec {load_name} {name}: {s['out_tok_s']:.1f} tok/s, acceptance "
                  f"{accepted}/{drafted}", flush=True)
            rows.append(_row("spec", f"{load_name}, {name}",
                             "all at t=0" if math.isinf(c.rate) else c.rate, s))
        info[f"{load_name} same output lengths"] = len(set(map(tuple, tokens.values()))) == 1
    return rows, info


# --------------------------------------------------------------------------- run


def _plot(rows, info):
    def draw(fig):
        axes = fig.subplots(1, 3)
        sw = [r for r in rows if r["section"] == "sweep"]
        if sw:
            rates = [r["rate"] for r in sw]
            ax = axes[0]
            for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "s--"),
                               ("tpot_p50_ms", "^-")):
                ax.plot(rates, [r[key] for r in sw], style, label=key.replace("_ms", ""))
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("offered load (req/s)")
            ax.set_ylabel("latency (ms)")
            ax.legend(fontsize=7)
            ax.set_title("HTTP sweep: latency", fontsize=9)
            ax = axes[1]
            ax.plot(rates, [r["out_tok_s"] for r in sw], "o-", label="throughput")
            ax.plot(rates, [r["goodput_req_s"] * r["mean_out_tokens"] for r in sw], "s--",
                    label="goodput (tok/s in SLO)")
            ax.set_xscale("log")
            ax.set_xlabel("offered load (req/s)")
            ax.set_ylabel("output tokens/s")
            ax.legend(fontsize=7)
            ax.set_title("HTTP sweep: throughput", fontsize=9)
        pf = [r for r in rows if r["section"] == "prefix"]
        if pf:
            ax = axes[2]
            on = [r for r in pf if "cache on" in r["variant"]]
            off = [r for r in pf if "cache off" in r["variant"]]
            ax.plot([r["hit_rate"] for r in on], [r["ttft_p50_ms"] for r in on], "o-",
                    label="cache on (measured hit rate)")
            ax.plot([r["predicted_hit_rate"] for r in on], [r["ttft_p50_ms"] for r in on],
                    "x:", label="same TTFT at predicted k*r/(k+1)")
            ax.plot([r["hit_rate"] for r in on], [r["ttft_p50_ms"] for r in off], "s--",
                    label="cache off")
            ax.set_xlabel("prefix-cache hit rate (prompt tokens)")
            ax.set_ylabel("TTFT p50 (ms)")
            ax.legend(fontsize=7)
            ax.set_title("shared-prefix groups", fontsize=9)
    return draw


def run(config, out_dir) -> common.Report:
    del out_dir
    model, tok = load(config.gguf_path or None)
    unknown = set(config.sections) - {"sweep", "batching", "tasq", "prefix", "spec"}
    if unknown:
        raise ValueError(f"config.sections has unknown names {sorted(unknown)}")
    rows, extra, claims = [], {}, []
    t0 = time.perf_counter()
    engine = _engine(model, tok, config)
    extra["warmup_s"] = time.perf_counter() - t0
    extra["stop_token_ids"] = list(default_stop_tokens(tok))
    failed = {}

    def attempt(name, fn, *args):
        """Run one section; a failure is recorded in the results (notes, extra), and the
        other sections still run."""
        if name not in config.sections:
            return None
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - reported in the results, never hidden
            import traceback
            failed[name] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
            return None

    out = attempt("sweep", sweep, engine, tok, config)
    rows += out or []
    b = attempt("batching", batching, engine, tok, config)
    if b:
        rows += b
        claims.append({"claim": "continuous/static throughput (same load)", "target": "> 1",
                       "measured": b[0]["out_tok_s"] / b[1]["out_tok_s"],
                       "met": b[0]["out_tok_s"] > b[1]["out_tok_s"]})
        claims.append({"claim": "static/continuous p99 TTFT", "target": "> 1",
                       "measured": b[1]["ttft_p99_ms"] / b[0]["ttft_p99_ms"],
                       "met": b[1]["ttft_p99_ms"] > b[0]["ttft_p99_ms"]})
    out = attempt("prefix", prefix, model, tok, engine, config)
    if out:
        p, extra["prefix"] = out
        rows += p
    out = attempt("spec", spec, model, tok, engine, config)
    if out:
        s, extra["spec"] = out
        rows += s
        rep = [r for r in s if r["variant"].startswith("repetitive")]
        claims.append({"claim": "spec decoding speed-up, repetitive load", "target": "> 1",
                       "measured": rep[1]["out_tok_s"] / rep[0]["out_tok_s"],
                       "met": rep[1]["out_tok_s"] > rep[0]["out_tok_s"]})
    del engine
    out = attempt("tasq", tasq_vs_bf16, model, tok, config)
    if out:
        t, extra["tasq"] = out
        rows += t
        ti = extra["tasq"]
        claims.append({"claim": "TaSQ 1-bit / bf16 peak concurrent sequences (same bytes)",
                       "target": "> 1", "measured": ti["tasq-1bit"]["peak_running"]
                       / max(1, ti["bf16"]["peak_running"]),
                       "met": ti["tasq-1bit"]["peak_running"] > ti["bf16"]["peak_running"]})
        claims.append({"claim": "TaSQ 1-bit / bf16 peak throughput (paper: 1.87x in SGLang)",
                       "target": "1.87", "measured": ti["tasq-1bit"]["out_tok_s"]
                       / ti["bf16"]["out_tok_s"],
                       "met": ti["tasq-1bit"]["out_tok_s"] / ti["bf16"]["out_tok_s"] >= 1.87})
    notes = [f"SLOs: TTFT <= {config.slo.ttft_s} s and TPOT <= {config.slo.tpot_s} s; "
             f"goodput = requests/s meeting both",
             f"engine: {dict(config.engine)}; latencies from arrival (HTTP: measured at the "
             f"client from SSE chunks)"]
    extra["failed_sections"] = failed
    notes += [f"section {k} FAILED: {v}" for k, v in failed.items()]
    for key, val in extra.get("prefix", {}).items():
        notes.append(f"prefix {key}: cached fraction {val['cached_fraction']:.3f}, predicted "
                     f"{val['predicted']:.3f} (block-rounded {val['predicted_block_rounded']:.3f})"
                     + "".join(f", {k} ${v:.3f}" for k, v in val.items()
                               if k.startswith("cost")))
    for key, val in extra.get("spec", {}).items():
        if isinstance(val, dict):
            notes.append(f"spec {key}: accepted {val['accepted']}/{val['drafted']} drafts")
    if "tasq" in extra:
        ti = extra["tasq"]
        notes.append(f"tasq: budget {ti['budget_bytes']} bytes = "
                     f"{config.tasq.budget_bf16_blocks} bf16 blocks; block bytes "
                     f"{ti['block_bytes']}; blocks bf16 {ti['bf16']['n_blocks']}, tasq "
                     f"{ti['tasq-1bit']['n_blocks']}; pool capacity (sequences of "
                     f"{config.tasq.prompt_tokens}+{config.tasq.max_tokens} tokens) bf16 "
                     f"{ti['bf16']['pool_capacity_seqs']}, tasq "
                     f"{ti['tasq-1bit']['pool_capacity_seqs']} (max_batch "
                     f"{config.tasq.max_batch}); preemptions bf16 "
                     f"{ti['bf16']['preemptions']}, tasq {ti['tasq-1bit']['preemptions']}")
    return common.Report(columns=COLUMNS, rows=rows, claims=claims, extra=extra, notes=notes,
                         title="servax serve: continuous batching engine and HTTP server (CPU)",
                         plot=_plot(rows, extra))
