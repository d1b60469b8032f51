"""DynaCore experiment (see dynacore.py for the command): quality on held-out text (dev
choice of zero points, test rows, the prefill/decode handoff matrix), CPU speed in one
process vs llama.cpp on the same GGUF, the modeled roofline for Llama-3.1-70B, and the
disaggregation costs (KV size, transfer, a measured two-process handoff, crossover,
billing)."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, protocol
from research import data
from research.core.timing import time_fn
from research.dynacore import (BF16, GPUS, H200, LINKS, LLAMA_31_70B, METHODS, W4A16_G64,
                               W8A8, ZERO_POINTS, DecodeProcess, Pool, QuantConfig,
                               calibrate_weights, calibration_stats, crossover_tokens,
                               dynacore, evaluate_pairs, kv_bytes, quantize, request_cost,
                               tasq_codebook_bytes, tpot_s, transfer_s, ttft_s, w4a16, w8a8,
                               w8a16, weight_bytes, windows)
from research.model import default_gguf_path, load
from research.decode.generate import decode_loop, prefill
from research.decode.sampling import SamplingConfig
from research.transforms import CalibrationData, calibrate_and_apply

TECHNIQUE = "dynacore"
# the W8A8 SmoothQuant strength and the W4A16 grid and method are chosen inside each run on
# its dev windows (disjoint from the test windows, `choose_on_dev`), recorded in
# extra.quality.dev_rows
DEFAULTS_CHOSEN_ON = ("python -m experiments.run --config=experiments/dynacore/dynacore.py:"
                      "small (its dev windows: extra.quality.dev_rows)")


def defaults(config) -> dict:
    """DynaCore's settings: the candidates each phase's scheme is chosen from on dev, the
    calibration data and the quality protocol."""
    q = config.quality
    return {"prefill": "W8A8 (int8 per-channel weights, per-token int8 activations), "
                       f"SmoothQuant strength chosen on dev among {tuple(q.dev_smooth)} "
                       "and off",
            "decode": f"W4A16 g{q.dev_group}, grid (zero point none/int/float) and method "
                      "(rtn/gptq) chosen on dev",
            "choice": "lowest dev KL(f32 || setting) on decoded tokens",
            "calibration": f"{q.cal_seqs} x {q.window} tokens of the calibration split",
            "window": q.window, "n_prefill": q.n_prefill, "dev_windows": q.dev_windows,
            "test_windows": q.test_windows,
            "text": "dev windows from the dev half, test windows from the test half of the "
                    "held-out topics (research.data.corpus_text, docs/protocol.md)"}


def prior_scorings() -> list[dict]:
    """Test scorings before the item ledger (issue 36), for `protocol.seed_history`."""
    return [
        {"label": "issue36:dynacore_small-old-offset-windows", "count": 3,
         "scorings_of": "dynacore_small",
         # the two old-default scorings (run ledger at 7c5d314) and the one at 013d367
         "scored_utc": ["2026-12-03T08:42:51Z", "2026-12-03T09:18:54Z",
                        "2026-12-03T13:37:47Z"], "reason": (
            "issue 36: dynacore_small's 8 test windows (held-out text by offset, windows 4-11 "
            "of 256 tokens) were scored twice with the old defaults and once more at 013d367 "
            "(ledger history at 7c5d314); dynacore_full's dev windows 0-7 also held windows "
            "4-7. The windows now come from the protocol's test half"),
         "items": protocol.heldout_windows([(i * 256, (i + 1) * 256) for i in range(4, 12)])},
        {"label": "issue36:dynacore_full-old-offset-windows", "count": 1,
         "scorings_of": "dynacore_full", "reason": (
            "dynacore_full at 7ced55b: 32 test windows of 256 tokens by offset (windows "
            "8-39) from the held-out text (run ledger: 1 scoring)"),
         "items": protocol.heldout_windows([(i * 256, (i + 1) * 256) for i in range(8, 40)])},
    ]


def quality_windows(tok, config, split: str) -> np.ndarray:
    """[n, window] token windows of `split` ("dev" / "test"): the first n consecutive
    windows of that half of the held-out prose (the protocol's topic-hashed halves, so a
    dev window never shares text with a test window)."""
    q = config.quality
    n = q.dev_windows if split == "dev" else q.test_windows
    text = config.get("test_text", "pydoc") if split == "test" else "pydoc"
    return windows(tok.encode(data.split_text(split, text)), q.window, n, 0)


def test_items(config) -> list:
    """The test windows the quality section scores (the item ledger,
    experiments/protocol.py); a run that does not compute the quality section scores none
    but reports the saved one, so its windows are declared all the same."""
    tok = common.tokenizer_only(config.gguf_path or None)
    text = ("fresh stdlib-docstring test text" if config.get("test_text", "pydoc") == "stdlib"
            else "pydoc test half")
    return [protocol.window_item(w, f"{text} tokens [{i * len(w)}, {(i + 1) * len(w)})")
            for i, w in enumerate(quality_windows(tok, config, "test"))]


COLUMNS = ["setting", "prefill", "decode", "linear MB", "ppl all", "ppl decoded",
           "dppl decoded %", "KL decoded", "KL prefill", "note"]
F32 = "f32"


# -- quality ---------------------------------------------------------------------------

def spec(cfg) -> dict:
    """A QuantConfig as JSON (saved sections, the speed subprocess): QuantConfig(**spec)."""
    return dataclasses.asdict(cfg)


class Models:
    """Single-setting models, built once (name -> Model). The data-aware settings share
    one pass of calibration statistics: the transform's calibrate, split in its two
    steps (`calibration_stats`, `calibrate_weights`), then its apply."""

    def __init__(self, model, cal):
        self.f32, self.cal, self.stats = model, cal, None
        self.cache = {F32: model, "bf16": model.astype(jnp.bfloat16)}

    def get(self, cfg):
        if isinstance(cfg, str):
            return self.cache[cfg]
        if cfg.name not in self.cache:
            if cfg.needs_data and self.stats is None:
                self.stats = calibration_stats(self.f32, [cfg], self.cal)
            state = calibrate_weights(self.f32, cfg, self.stats if cfg.needs_data else None)
            self.cache[cfg.name] = quantize(cfg).apply(self.f32, state)
        return self.cache[cfg.name]


def choose_on_dev(models: Models, dev, q):
    """On dev windows only: W8A8 with SmoothQuant off or at each strength, and W4A16 at
    the dev group size on each grid with each method; the lowest KL on decoded tokens wins
    in each family. Returns (w8 config, w4 config, dev rows)."""
    w8s = [w8a8()] + [w8a8(smooth=a) for a in q.dev_smooth]
    w4s = [w4a16(q.dev_group, zero_point=zp, method=m) for zp in ZERO_POINTS
           for m in METHODS]
    pairs = {F32: (models.f32, models.f32)}
    pairs.update({c.name: (models.get(c), models.get(c)) for c in w8s + w4s})
    scores = evaluate_pairs(pairs, pairs[F32], dev, q.n_prefill, q.batch_size)
    ref = scores.pop(F32)
    rows = [{"setting": name, "ppl all": s.ppl_all, "ppl decoded": s.ppl_decode,
             "dppl all %": 100 * (s.ppl_all / ref.ppl_all - 1), "KL decoded": s.kl_decode}
            for name, s in scores.items()]
    best = lambda cs: min(cs, key=lambda c: scores[c.name].kl_decode)  # noqa: E731
    return best(w8s), best(w4s), rows


def quality(model, tok, config):
    q = config.quality
    dev = quality_windows(tok, config, "dev")  # disjoint halves (docs/protocol.md)
    test = quality_windows(tok, config, "test")
    cal = CalibrationData.from_corpus(tok, q.window, q.cal_seqs)
    models = Models(model, cal)
    w8, w4, dev_rows = choose_on_dev(models, dev, q)
    settings = {F32: F32, "bf16": "bf16"}
    if w8.smooth is not None:
        settings["W8A8"] = w8a8()  # the plain scheme beside the chosen one
    settings.update({w8.name: w8, "W8A16": w8a16()})
    baseline_w4 = w4a16(q.dev_group)  # round to nearest, integer zero (qwix minmax)
    if baseline_w4.name != w4.name:
        settings[baseline_w4.name] = baseline_w4
    skipped = {}
    for g in q.group_sizes:
        cfg = w4a16(g, zero_point=w4.zero_point, method=w4.method)
        try:
            models.get(cfg)
            settings[cfg.name] = cfg
        except ValueError as e:  # e.g. g=128 does not divide SmolLM2's 576-wide inputs
            skipped[cfg.name] = str(e)
    # rows: every single setting, DynaCore, then the handoff matrix's mixed pairs
    pairs = {name: (name, name) for name in settings}
    dc_name = f"DynaCore ({w8.name} | {w4.name})"
    pairs[dc_name] = (w8.name, w4.name)
    for p in (F32, w8.name, w4.name):
        for d in (F32, w8.name, w4.name):
            if p != d and (p, d) != (w8.name, w4.name):
                pairs[f"handoff {p} -> {d}"] = (p, d)
    get = lambda n: models.get(settings.get(n, n))  # noqa: E731
    built = {}
    for name, (p, d) in pairs.items():
        if name == dc_name:  # the real dynacore transform: one model, two sets
            dc, _ = calibrate_and_apply(dynacore(w8, w4), model, cal)
            built[name] = (dc.prefill_model, dc.decode_model)
            dc_bytes = weight_bytes(dc)["linear"]
        else:
            built[name] = (get(p), get(d))
    t0 = time.perf_counter()
    scores = evaluate_pairs(built, (model, model), test, q.n_prefill, q.batch_size)
    elapsed = time.perf_counter() - t0
    f32 = scores[F32]
    rows = []
    for name, (p, d) in pairs.items():
        s = scores[name]
        mb = (dc_bytes if name == dc_name else
              weight_bytes(get(p))["linear"] if p == d else float("nan")) / 1e6
        rows.append({"setting": name, "prefill": p, "decode": d, "linear MB": mb,
                     "ppl all": s.ppl_all, "ppl decoded": s.ppl_decode,
                     "dppl decoded %": 100 * (s.ppl_decode / f32.ppl_decode - 1),
                     "KL decoded": s.kl_decode, "KL prefill": s.kl_prefill, "note": ""})
    for name, err in skipped.items():
        rows.append({"setting": name, "note": "not run: " + err})
    extra = {"dev_rows": dev_rows, "w8a8": spec(w8), "w4a16": spec(w4), "eval_s": elapsed,
             "n_test_windows": int(len(test)), "n_dev_windows": int(len(dev)),
             "calibration_tokens": int(cal.tokens.size),
             "embed_MB": weight_bytes(model)["embed"] / 1e6,
             "decoded_tokens": f32.n_decode_tokens, "prefill_tokens": f32.n_prefill_tokens}
    return rows, extra, w8, w4


# -- speed -----------------------------------------------------------------------------

def speed(config, out_dir, w8, w4):
    s = config.speed
    gguf = config.gguf_path or str(default_gguf_path())
    flags = (f"--xla_cpu_multi_thread_eigen={'true' if s.threads > 1 else 'false'} "
             f"intra_op_parallelism_threads={s.threads}")
    env = dict(os.environ, XLA_FLAGS=flags, OMP_WAIT_POLICY="PASSIVE")
    path = os.path.join(out_dir, "speed.json")
    subprocess.run([sys.executable, "-m", "experiments.dynacore.speed", "--out", path,
                    "--gguf", gguf, "--prompt", str(s.prompt), "--context", str(s.context),
                    "--decode", str(s.decode), "--batches", s.batches,
                    "--repeats", str(s.repeats), "--w8", json.dumps(spec(w8)),
                    "--w4", json.dumps(spec(w4))], check=True, env=env)
    with open(path) as f:
        sp = json.load(f)
    peer = None
    if s.peer_python and os.path.exists(s.peer_python):
        out = subprocess.run([s.peer_python, "experiments/dynacore/peer_llamacpp.py",
                              "--gguf", gguf, "--workdir", os.path.join(out_dir, "peer"),
                              "--threads", str(s.threads), "--prompt", str(s.prompt),
                              "--decode", str(s.decode), "--repeats", str(s.repeats)],
                             check=True, env=env, capture_output=True, text=True)
        peer = json.loads(out.stdout.strip().splitlines()[-1])
    rows = []
    for v, r in sp["prefill"].items():
        rows.append({"engine": "servax (XLA CPU)", "variant": v, "phase": "prefill",
                     "batch": 1, "tok/s": r["tok_s"],
                     "vs f32": r["tok_s"] / sp["prefill"][F32]["tok_s"]})
    for key, r in sp["decode"].items():
        base = sp["decode"][f"f32 b{r['batch']}"]["tok_s"]
        rows.append({"engine": "servax (XLA CPU)", "variant": r["variant"], "phase": "decode",
                     "batch": r["batch"], "tok/s": r["tok_s"], "vs f32": r["tok_s"] / base})
    if peer:
        for v in ("Q4_1", "Q8_0"):
            rows.append({"engine": "llama.cpp", "variant": v, "phase": "prefill", "batch": 1,
                         "tok/s": peer[v]["prefill_tok_s"], "vs f32": float("nan")})
            rows.append({"engine": "llama.cpp", "variant": v, "phase": "decode", "batch": 1,
                         "tok/s": peer[v]["decode_tok_s"], "vs f32": float("nan")})
    return rows, {"speed": sp, "peer": peer, "threads": s.threads, "xla_flags": flags}


def hlo_check(model, w4) -> dict:
    """Whether XLA (CPU) writes whole dequantized weights in a compiled W4A16 decode step
    (speed.hlo_materialization), beside the f32 step: a compile, no timing. `w4` has zero
    points (the check is about the dequantize-then-dot structure, the same without)."""
    from experiments.dynacore.speed import hlo_materialization
    q, _ = calibrate_and_apply(quantize(w4), model, None)
    return {"w4a16": hlo_materialization(q), "f32": hlo_materialization(model)}


# -- roofline --------------------------------------------------------------------------

def roofline_tables(config):
    r = config.roofline
    c = LLAMA_31_70B
    kw = dict(n_gpus=r.n_gpus, mfu=r.mfu, mbu=r.mbu)
    pre, dec = [], []
    for gname, gpu in GPUS.items():
        for p in r.prompts:
            bf = ttft_s(c, p, BF16, gpu, **kw)
            q8 = ttft_s(c, p, W8A8, gpu, **kw)
            w4 = ttft_s(c, p, W4A16_G64, gpu, **kw)
            pre.append({"gpu": f"{r.n_gpus}x{gname}", "prompt": p, "TTFT bf16 ms": 1e3 * bf,
                        "TTFT W8A8 ms": 1e3 * q8, "TTFT W4A16 ms": 1e3 * w4,
                        "bf16/W8A8": bf / q8, "W4A16/W8A8": w4 / q8})
        for b in r.batches:
            bf = tpot_s(c, b, r.context, BF16, gpu, **kw)
            w4 = tpot_s(c, b, r.context, W4A16_G64, gpu, **kw)
            q8 = tpot_s(c, b, r.context, W8A8, gpu, **kw)
            dec.append({"gpu": f"{r.n_gpus}x{gname}", "batch": b, "context": r.context,
                        "TPOT bf16 ms": 1e3 * bf, "TPOT W4A16 ms": 1e3 * w4,
                        "TPOT W8A8 ms": 1e3 * q8, "bf16/W4A16": bf / w4})
    return pre, dec


# -- disaggregation --------------------------------------------------------------------

def disagg_tables(config):
    d = config.disagg
    c = LLAMA_31_70B
    kv16 = kv_bytes(c, d.tokens, 16)
    kv1 = kv_bytes(c, d.tokens, 1)
    books = tasq_codebook_bytes(c)
    calc = []
    for label, nbytes in (("bf16 KV", kv16), ("TaSQ 1-bit codes", kv1)):
        row = {"model": "Llama-3.1-70B", "tokens": d.tokens, "KV": label, "GB": nbytes / 1e9}
        for link, bps in LINKS.items():
            row[f"ms @ {link}"] = 1e3 * transfer_s(nbytes, bps)
        calc.append(row)
    # modeled crossover on 8xH200: "standalone" recompute = the bf16 TTFT roofline (with
    # its weight-read floor); "marginal" = compute only (the prompt joins a busy prefill
    # batch, weights already streaming); moving the KV pays an assumed 100 us setup
    links = dict(LINKS, **{"25 Gbps": 25e9})
    cross = {}
    for link, bps in links.items():
        for label, bits in (("bf16", 16), ("1-bit", 1)):
            move = lambda p, bits=bits, bps=bps: transfer_s(  # noqa: E731
                kv_bytes(c, p, bits), bps, latency_s=100e-6)
            cross[f"{label} @ {link}, standalone"] = crossover_tokens(
                lambda p: ttft_s(c, p, BF16, H200), move)
            cross[f"{label} @ {link}, marginal"] = crossover_tokens(
                lambda p: ttft_s(c, p, BF16, H200, mbu=float("inf")), move)
    # billing: per-second, one request of d.prompt tokens and d.new_tokens out
    h200 = Pool("8xH200", 8, d.usd_per_gpu_hour_h200)
    ttft = ttft_s(c, d.prompt, W8A8, H200)
    tpot = tpot_s(c, d.decode_batch, d.prompt, W4A16_G64, H200)
    move = transfer_s(kv_bytes(c, d.prompt), LINKS["6.4 Tbps"])
    bill = request_cost(h200, h200, ttft, tpot, d.new_tokens, d.decode_batch)
    bill.update(ttft_s=ttft, tpot_s=tpot, kv_move_s=move, prompt=d.prompt,
                new_tokens=d.new_tokens, decode_batch=d.decode_batch,
                usd_per_gpu_hour=d.usd_per_gpu_hour_h200)
    return calc, {"crossover_tokens_modeled_8xH200": cross, "billing": bill,
                  "tasq_codebook_bytes_70b": books}


def measured_handoff(model, tok, config):
    """Real SmolLM2 prefill state sent to a decode process (loopback TCP): f32 K/V, then
    TaSQ 1-bit codes; vs recomputing the prefill locally. For f32 the decode process
    decodes and its greedy tokens are compared with a local decode from the same state;
    TaSQ's codes are transferred only (its decode-loop compile takes many minutes on this
    loaded CPU; decoding a handed-off cache is tested for f32 and is codec-independent)."""
    from research.tasq import TaSQConfig, tasq
    d = config.disagg
    ids = tok.encode(data.corpus_text("dev"))  # a timing of the handoff: dev text
    cal = CalibrationData.from_corpus(tok, 256, d.tasq_seqs)
    tcfg = TaSQConfig(bits=1, kmeans_iters=d.tasq_iters, max_points=4096, seed=config.seed)
    tmodel, tstate = calibrate_and_apply(tasq(tcfg), model, cal)
    rows = []
    with DecodeProcess(gguf=config.gguf_path or None) as dp:
        for label, m in (("f32 K/V", model), ("TaSQ 1-bit codes", tmodel)):
            if m is tmodel:
                dp.setup("research.tasq:tasq", (tcfg,), jax.tree.map(np.asarray, tstate))
            # one cache length for every prompt: one decode-loop compile per model
            max_len = max(d.prompts) + d.decode_tokens
            for p in d.prompts:
                toks = jnp.asarray(np.asarray(ids[:p], np.int32)[None])
                lens = jnp.asarray([p], jnp.int32)
                run = lambda: prefill(m, toks, lens, m.init_cache(1, max_len))  # noqa: E731
                recompute = time_fn(run, warmup=1, repeats=d.repeats)["median_s"]
                logits, states = run()
                local = None
                if m is model:  # TaSQ: transfer only (see the docstring)
                    local = decode_loop(m, logits, lens, states, jax.random.key(0),
                                        max_new_tokens=d.decode_tokens,
                                        sampling=SamplingConfig(), stop_tokens=())
                n_dec = d.decode_tokens if local is not None else 0  # TaSQ: transfer only
                dp.handoff(logits, lens, states, max_len, n_dec)  # warm-up
                res = [dp.handoff(logits, lens, states, max_len, n_dec)
                       for _ in range(d.repeats)]
                move = statistics.median(r["transfer_s"] for r in res)
                rows.append({"KV": label, "prompt": p, "KV bytes": res[0]["kv_bytes"],
                             "wire bytes": res[0]["wire_bytes"], "transfer ms": 1e3 * move,
                             "recompute ms": 1e3 * recompute,
                             "move beats recompute": bool(move < recompute),
                             "same tokens": "not checked" if local is None else
                             bool(np.array_equal(res[0]["tokens"], np.asarray(local.tokens)))})
    return rows


# -- report ----------------------------------------------------------------------------

def _section(out_dir, name: str, compute: bool, fn):
    """Compute a section and save it as <out_dir>/section_<name>.json with the git state,
    or (when `name` is not in config.sections) load the one a previous run saved; the
    loaded ones and their git states are listed in results.json (extra.reused_sections).
    Lets the timing sections run under the bench lock apart from the quality section."""
    path = os.path.join(out_dir, f"section_{name}.json")
    if not compute:
        if not os.path.exists(path):
            MISSING.append(name)
            return None
        with open(path) as f:
            saved = json.load(f)
        REUSED[name] = saved["git"]
        return saved["result"]
    result = fn()
    with open(path, "w") as f:
        json.dump({"git": common.git_state(), "result": result}, f,
                  default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    with open(path) as f:  # the same JSON types whether computed or reused
        return json.load(f)["result"]


REUSED: dict = {}
MISSING: list = []  # sections neither computed nor saved: absent from the report


def run(config, out_dir=None) -> common.Report:
    out_dir = out_dir or tempfile.mkdtemp()
    os.makedirs(out_dir, exist_ok=True)
    loaded = []

    def model_tok():  # loaded only when a section is computed here
        if not loaded:
            loaded.append(load(config.gguf_path or None))
        return loaded[0]

    sections = {s for s in config.sections.split(",") if s}
    unknown = sections - {"quality", "hlo", "speed", "handoff"}
    if unknown:
        raise ValueError(f"config.sections: unknown {sorted(unknown)}; expected a comma list "
                         "of quality, hlo, speed, handoff")
    # the HLO check does not depend on the quality section's dev choice: the structure
    # (dequantize, then dot) is the same on every grid; round to nearest, integer zeros
    hlo_out = _section(out_dir, "hlo", "hlo" in sections, lambda: hlo_check(
        model_tok()[0], w4a16(config.quality.dev_group)))
    quality_out = _section(out_dir, "quality", "quality" in sections, lambda: (
        lambda r: (r[0], r[1], spec(r[2]), spec(r[3])))(quality(*model_tok(), config)))
    if quality_out is None:
        raise ValueError("the quality section was neither computed nor saved: include "
                         "'quality' in config.sections")
    q_rows, q_extra = quality_out[:2]
    w8, w4 = (QuantConfig(**c) for c in quality_out[2:])
    pre_rows, dec_rows = roofline_tables(config)
    calc_rows, d_extra = disagg_tables(config)
    speed_out = _section(out_dir, "speed", "speed" in sections,
                         lambda: speed(config, out_dir, w8, w4))
    hand_rows = _section(out_dir, "handoff", "handoff" in sections,
                         lambda: measured_handoff(*model_tok(), config))
    s_rows, s_extra = speed_out if speed_out is not None else (None, None)
    if s_extra is None and hlo_out is not None:
        s_extra = {"speed": {"hlo_w4a16": hlo_out["w4a16"], "hlo_f32": hlo_out["f32"]},
                   "peer": None}
    claims, notes = make_claims(q_rows, s_rows, s_extra, pre_rows, dec_rows, calc_rows,
                                w8, w4, q_extra, d_extra)
    notes += [f"section {m!r} was not run (config.sections={config.sections!r}); its table "
              "is absent" for m in MISSING]
    tables = []
    if s_rows is not None:
        tables.append(
            {"title": f"CPU speed (one process, {config.speed.threads} thread(s) for XLA and "
                      "llama.cpp, medians after warm-up)",
             "columns": ["engine", "variant", "phase", "batch", "tok/s", "vs f32"],
             "rows": s_rows})
    tables += [
        {"title": "MODELED TTFT, Llama-3.1-70B, one prompt (roofline, datasheet rates)",
         "columns": list(pre_rows[0]), "rows": pre_rows},
        {"title": "MODELED TPOT, Llama-3.1-70B (roofline, datasheet rates)",
         "columns": list(dec_rows[0]), "rows": dec_rows},
        {"title": "KV size and transfer time (calculator)", "columns": list(calc_rows[0]),
         "rows": calc_rows}]
    if hand_rows is not None:
        tables.append(
            {"title": "Measured KV handoff between two processes (SmolLM2, loopback TCP)",
             "columns": list(hand_rows[0]), "rows": hand_rows})
    return common.Report(
        columns=COLUMNS, rows=q_rows, tables=tables, claims=claims, notes=notes,
        title=f"DynaCore on SmolLM2-135M-Instruct ({q_extra['n_test_windows']} test windows "
              f"of {config.quality.window}, {config.quality.n_prefill} prefilled)",
        plot=lambda fig: plot(fig, q_rows, dec_rows),
        extra={"quality": q_extra, **(s_extra or {}), "disagg": d_extra,
               "measured_handoff": hand_rows, "reused_sections": dict(REUSED),
               "missing_sections": list(MISSING)})


def make_claims(q_rows, s_rows, s_extra, pre_rows, dec_rows, calc_rows, w8, w4, q_extra,
                d_extra):
    by = {r["setting"]: r for r in q_rows}
    f32 = by[F32]
    pct = lambda n, k="ppl all": 100 * (by[n][k] / f32[k] - 1)  # noqa: E731
    dc = next(r for r in q_rows if r["setting"].startswith("DynaCore"))
    claims = [
        common.claim(f"{w8.name} ppl within 1% of f32 (all tokens)", "<= 1%",
                     f"{pct(w8.name):+.2f}%", abs(pct(w8.name)) <= 1),
        common.claim(f"{w4.name} ppl within 5% of f32", "<= 5%", f"{pct(w4.name):+.2f}%",
                     abs(pct(w4.name)) <= 5),
        common.claim("DynaCore no worse than W4A16 alone (decoded tokens)",
                     f"ppl <= {by[w4.name]['ppl decoded']:.4f}",
                     f"{dc['ppl decoded']:.4f} (KL {dc['KL decoded']:.4f} vs "
                     f"{by[w4.name]['KL decoded']:.4f})",
                     dc["ppl decoded"] <= by[w4.name]["ppl decoded"] * (1 + 1e-4)),
        common.claim("TTFT up to 3.50x (seed)", "3.50x",
                     f"modeled bf16/W8A8 max {max(r['bf16/W8A8'] for r in pre_rows):.2f}x",
                     False),
        common.claim("TPOT up to 36.55x (seed)", "36.55x",
                     f"modeled bf16/W4A16 max {max(r['bf16/W4A16'] for r in dec_rows):.2f}x",
                     False),
        common.claim("32k-token Llama-3.1-70B KV ~10 GB (seed)", "~10 GB",
                     f"{calc_rows[0]['GB']:.2f} GB bf16", abs(calc_rows[0]["GB"] - 10.7) < 0.1),
    ]
    peer = s_extra["peer"] if s_extra else None
    mine = next((r for r in s_rows if r["variant"] == w4.name and r["batch"] == 1
                 and r["phase"] == "decode"), None) if s_rows else None
    if peer and mine:
        ratio = mine["tok/s"] / peer["Q4_1"]["decode_tok_s"]
        claims.append(common.claim("servax W4A16 decode b1 >= llama.cpp Q4_1 (goal)",
                                   ">= 1.0x", f"{ratio:.3f}x", ratio >= 1))
    hlo = s_extra["speed"]["hlo_w4a16"]["weight_shaped_f32_arrays"] if s_extra else None
    notes = [
        f"chosen on dev windows only (lowest KL on decoded tokens): prefill {w8.name}, "
        f"decode {w4.name} (dev rows in results.json extra.quality.dev_rows); GPTQ and "
        f"SmoothQuant calibrate on {q_extra['calibration_tokens']} tokens of the "
        "calibration split",
        "the embedded GGUF stores SmolLM2 in llama.cpp's Q4_1 (4-bit, groups of 32 inputs, "
        "a float scale and minimum each): the f32 reference is those weights dequantized, "
        "so a g32 grid with a float zero can hold them exactly, and g64 must merge two "
        "Q4_1 groups into one grid",
        "the tied embedding / LM head stays float in every row "
        f"({q_extra['embed_MB']:.0f} MB f32); 'linear MB' counts the real arrays of every "
        "quantized linear weight (codes, scales, zero points; DynaCore: both sets)",
        ("W4A16 decode on CPU runs the XLA reference: the compiled decode step holds "
         + ", ".join(f"{v['count']} f32[{k.replace('x', ',')}] arrays"
                     for k, v in hlo.items())
         + " (whole dequantized weights written every step, then a dense dot); the Pallas "
         "kernel, which dequantizes one tile at a time, is what TPU/GPU run")
        if hlo else "speed section not run: no HLO check in this run",
        "TTFT/TPOT tables are MODELED (research/dynacore/roofline.py: datasheet rates, "
        "mfu 0.6, mbu 0.8, 8 GPUs as one ideal tensor-parallel device)",
        f"modeled crossover prompt length (8xH200 bf16 recompute vs moving the KV): "
        f"{d_extra['crossover_tokens_modeled_8xH200']}",
        f"per-second billing (assumed ${d_extra['billing']['usd_per_gpu_hour']}/GPU-hour, "
        f"8xH200 pools, modeled times): prefill ${d_extra['billing']['prefill_usd']:.5f} + "
        f"decode ${d_extra['billing']['decode_usd']:.5f} per request of "
        f"{d_extra['billing']['prompt']} in / {d_extra['billing']['new_tokens']} out "
        f"(decode batch {d_extra['billing']['decode_batch']})",
    ]
    return claims, notes


def plot(fig, q_rows, dec_rows):
    ax1, ax2 = fig.subplots(1, 2)
    rows = [r for r in q_rows if "KL decoded" in r]
    ax1.barh([r["setting"] for r in rows], [r["KL decoded"] for r in rows])
    ax1.set_xlabel("KL(f32 || setting) per decoded token (nats)")
    ax1.tick_params(axis="y", labelsize=7)
    for gpu in sorted({r["gpu"] for r in dec_rows}):
        rr = [r for r in dec_rows if r["gpu"] == gpu]
        ax2.plot([r["batch"] for r in rr], [r["bf16/W4A16"] for r in rr], "o-", label=gpu)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("decode batch")
    ax2.set_ylabel("MODELED TPOT bf16 / W4A16")
    ax2.legend()
