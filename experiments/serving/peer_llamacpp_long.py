r"""Peer at long context: llama.cpp with quantized KV caches vs servax's engine, batch 1.

Command:   python -m experiments.run --config=experiments/serving/peer_llamacpp_long.py:small
Needs:     a Python with `llama-cpp-python` (config.peer_python; not a servax dependency,
           so this script is not part of CI or `make test`). Run it on an otherwise idle
           machine: llama.cpp's threads spin-wait, and with the cores shared its steps
           slow down ~30x (measured here: 5.9 s per step at 300 tokens while three other
           runs held the 2 cores).
Hardware:  CPU, one process at a time (servax in this process, llama.cpp in a child).
What:      the same prompt (`context - decode_steps - 1` consecutive tokens of the
           calibration split), the same GGUF (SmolLM2-135M-Instruct Q4_1), greedy, batch 1:
           llama.cpp with K and V cached as f16, q8_0 and q4_0 (flash attention on, as
           quantized V needs; its Q4_1 weight kernels), servax's engine with bf16, int8
           and TaSQ 1-bit (pre- and post-RoPE keys) pages (f32 weights). Per setting:
           prefill seconds of the prompt and decode tok/s (median step after the first).
Nothing is tuned or scored here (speed only; a-priori settings).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ml_collections

from experiments import common

TECHNIQUE = "serving_peer_llamacpp"
DEFAULTS_CHOSEN_ON = "none: a-priori settings, speed only"
CHILD = Path(__file__).resolve().parent / "llamacpp_decode.py"
COLUMNS = ["server", "kv", "prompt_tokens", "prefill_s", "decode_tok_s", "step_ms",
           "vs_llamacpp_f16", "load_1min"]


def defaults(config) -> dict:
    return {k: config[k] for k in ("context", "decode_steps", "block_size", "prefill_chunk",
                                   "min_read_len")}


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.serving.peer_llamacpp_long", args=("small",),
                          run_name="serving_peer_llamacpp_long")
    c.peer_python = "/work/peer-venv/bin/python"
    c.threads = os.cpu_count() or 1
    c.context = 8192
    c.decode_steps = 16
    c.llamacpp_kv = ("f16", "q8_0", "q4_0")
    c.servax_kv = ("bf16", "int8", "tasq-1bit", "tasq-1bit-post")
    # servax engine settings of the long-context benchmark (long_context.py)
    c.block_size = 16
    c.prefill_chunk = 512
    c.min_read_len = 1024
    c.calibration_seqs = 4
    c.text_split = "calibration"
    return c


def llamacpp_row(config, gguf: str, ids_path: Path, kv: str) -> dict:
    out = subprocess.run([config.peer_python, str(CHILD), gguf, str(ids_path), kv,
                          str(config.decode_steps), str(config.threads)],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"llama.cpp ({kv}) failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"server": "llama.cpp " + r["llama_cpp"], "kv": kv, **{
        k: r[k] for k in ("prompt_tokens", "prefill_s", "decode_tok_s", "step_ms")},
        "tokens": r["tokens"], "load_1min": round(os.getloadavg()[0], 2)}


def servax_row(model, tok, prompt, kv: str, config) -> dict:
    from experiments.serving import long_context_experiment as L
    served = L.served_model(model, tok, kv, config)
    engine, prefill_s = L.rows_of_one_prompt(served, tok, prompt, 1, config)
    tokens, times = [], []
    for _ in range(config.decode_steps):
        t = time.perf_counter()
        _, toks = engine.generate(engine.state)
        times.append(time.perf_counter() - t)
        tokens += toks[0]
    step = statistics.median(times[1:])
    del engine, served
    L.release_compiled()
    return {"server": "servax", "kv": kv, "prompt_tokens": len(prompt),
            "prefill_s": prefill_s, "decode_tok_s": 1.0 / step, "step_ms": step * 1e3,
            "tokens": tokens, "load_1min": round(os.getloadavg()[0], 2)}


def run(config, out_dir) -> common.Report:
    from research import data
    from research.model import default_gguf_path, load
    model, tok = load(config.gguf_path or None)
    gguf = config.gguf_path or str(default_gguf_path())
    n = min(config.context, model.config.max_position) - config.decode_steps - 1
    prompt = tok.encode(data.corpus_text(config.text_split))[:n]
    ids_path = Path(out_dir) / "prompt_ids.json"
    ids_path.write_text(json.dumps(list(map(int, prompt))))
    rows = []
    for kv in config.llamacpp_kv:
        rows.append(llamacpp_row(config, gguf, ids_path, kv))
        print(rows[-1], flush=True)
    for kv in config.servax_kv:
        rows.append(servax_row(model, tok, prompt, kv, config))
        print(rows[-1], flush=True)
    ids_path.unlink()
    ref = next((r for r in rows if r["kv"] == "f16"), None)
    for r in rows:
        r["vs_llamacpp_f16"] = r["decode_tok_s"] / ref["decode_tok_s"] if ref else float("nan")
    best_peer = max((r for r in rows if r["server"] != "servax"),
                    key=lambda r: r["decode_tok_s"], default=None)
    best_servax = max((r for r in rows if r["server"] == "servax"),
                      key=lambda r: r["decode_tok_s"])
    claims = [common.claim(
        f"servax's fastest KV ({best_servax['kv']}) / llama.cpp's fastest "
        f"({best_peer['kv'] if best_peer else '-'}) decode tok/s at batch 1, "
        f"{n} tokens of context", "report",
        f"{best_servax['decode_tok_s'] / best_peer['decode_tok_s']:.2f}x"
        if best_peer else "no peer row", None)]
    notes = [f"batch 1, a prompt of {n} consecutive {config.text_split}-split tokens, "
             f"{config.decode_steps} greedy steps (median after the first), "
             f"{config.threads} threads for llama.cpp; servax: the engine (paged pool, "
             f"{config.prefill_chunk}-token chunked prefill, reads bucketed from "
             f"{config.min_read_len}), f32 weights dequantized from the same GGUF",
             "load_1min: the machine's 1-minute load average after each row (2 cores)",
             "greedy tokens differ between the servers where Q4_1 kernels and f32 "
             "weights round differently; each row's tokens are in results.json"]
    return common.Report(columns=COLUMNS, rows=rows, claims=claims, notes=notes,
                         title="llama.cpp quantized KV vs servax codecs at long context, "
                               "batch 1 (CPU)",
                         plot=lambda fig: _plot(fig, rows))


def _plot(fig, rows):
    ax = fig.add_subplot(1, 1, 1)
    ax.bar(range(len(rows)), [r["decode_tok_s"] for r in rows],
           color=["tab:orange" if r["server"] != "servax" else "tab:blue" for r in rows])
    ax.set_xticks(range(len(rows)), [("llama.cpp " if r["server"] != "servax" else
                                      "servax ") + r["kv"] for r in rows])
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_title(f"{rows[0]['prompt_tokens']} tokens of context")


if __name__ == "__main__":
    sys.exit("run through: python -m experiments.run "
             "--config=experiments/serving/peer_llamacpp_long.py:small")
