"""Long-context quality per KV codec (see long_context_quality.py for the command)."""
from __future__ import annotations

import time

import numpy as np

from experiments import common, protocol
from research import data

TECHNIQUE = "serving"
DEFAULTS_CHOSEN_ON = ("continuation 512 and chunk 512 fixed a priori (no dev run compared "
                      "others); passkey template 'plain' kept over 'chat' on dev (bf16 KV, "
                      "10 dev prompts at 2k: 0.4 vs 0.3; plain 0.1 at 4k, chat not run "
                      "there), max_new_tokens 8 not compared; the codecs run at their own "
                      "dev-chosen defaults (window S=4, W=128 and served-position "
                      "calibration: scripts/dev_tasq_calibration_positions.py)")

COLUMNS = ["length", "codec", "kv_bytes_per_token", "kl", "top1", "ppl", "ref_ppl",
           "passkey_acc", "passkey_tokens"]


def defaults(config) -> dict:
    return {"reference": config.reference, "continuation": config.continuation,
            "chunk": config.chunk, "calibration_seqs": config.calibration_seqs,
            "passkey": {k: config.passkey[k] for k in ("template", "max_new_tokens")}}


def split_text(config) -> str:
    """What the run reads: the pydoc dev half (dev) or the fresh test text (test)."""
    split = config.get("split", "test")
    if split == "dev":
        return data.split_text("dev")
    return data.split_text("test", config.get("test_text", "stdlib"))


def spread_windows(ids, n: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """([n, length] windows, [n] starts): starts spread evenly over `ids`; a text shorter
    than `length` is read cyclically (dev only: its windows repeat text)."""
    ids = np.asarray(ids, np.int32)
    if n < 1 or length < 2:
        raise ValueError(f"need n >= 1 windows of length >= 2, got {n}, {length}")
    if len(ids) >= length:
        starts = np.linspace(0, len(ids) - length, n).astype(np.int64)
    else:
        starts = np.linspace(0, len(ids), n, endpoint=False).astype(np.int64)
    return np.take(ids, starts[:, None] + np.arange(length), mode="wrap"), starts


def passkey_length(length: int, max_position: int, max_new_tokens: int) -> int:
    """Prompt tokens of a passkey trial at `length`: it and its answer fit the model."""
    return min(length, max_position - max_new_tokens)


def run_items(tok, config, max_position: int):
    """Per length: (windows, starts, passkey trials) the run scores, from the split's text."""
    from research.eval.passkey import passkey_trials
    text = split_text(config)
    ids = tok.encode(text)
    p = config.passkey
    if p.trials < 0:
        raise ValueError(f"passkey.trials must be >= 0 (0: no passkey), got {p.trials}")
    if config.windows < 0 or config.windows == p.trials == 0:
        raise ValueError(f"windows must be >= 0 (0: a passkey-only run) and windows and "
                         f"passkey.trials not both 0, got {config.windows}, {p.trials}")
    out = {}
    for length in config.lengths:
        wins, starts = (spread_windows(ids, config.windows, length) if config.windows
                        else (np.zeros((0, length), np.int32), np.zeros(0, np.int64)))
        trials = [] if p.trials == 0 else passkey_trials(
            tok, passkey_length(length, max_position, p.max_new_tokens), p.trials,
            config.seed, text, template=p.template)
        out[length] = (wins, starts, trials)
    return out


def test_items(config) -> list:
    """The quality windows and passkey prompts this test run scores (the item ledger)."""
    tok = common.tokenizer_only(config.gguf_path or None)
    max_position = common.model_config_only(config.gguf_path or None).max_position
    doc = f"fresh {config.get('test_text', 'stdlib')} test text"
    items = []
    for length, (wins, starts, trials) in run_items(tok, config, max_position).items():
        items += [protocol.window_item(w, f"{doc} tokens [{s}, {s + length}) (quality "
                                          "window)") for w, s in zip(wins, starts)]
        items += [protocol.window_item(np.asarray(t.ids), f"passkey {len(t.ids)} tokens, "
                                       f"depth {t.depth:.2f}, seed {config.seed}",
                                       kind="passkey") for t in trials]
    return items


def exact_part_models(served: dict, part: str) -> dict:
    """The K-or-V ablation of every served model: `part` ("k"/"v") kept in bfloat16,
    labelled "<codec> (K bf16)" (research/kv/exact_part.py)."""
    from research.kv.exact_part import kv_exact_part
    from research.transforms import calibrate_and_apply
    transform = kv_exact_part(part)
    return {f"{c} ({part.upper()} bf16)": calibrate_and_apply(transform, m, None)[0]
            for c, m in served.items()}


def run(config, out_dir) -> common.Report:
    del out_dir
    from experiments.serving.long_context_experiment import block_bytes
    from research.eval.divergence import divergences
    from research.eval.passkey import passkey_accuracy
    from research.model import load
    from research.serving import kv_codecs
    model, tok = load(config.gguf_path or None)
    codecs = [common.kv_codec_name(c) for c in config.codecs]
    ref = common.kv_codec_name(config.reference)
    built = kv_codecs.served_models(model, tok, [ref] + codecs, seed=config.seed,
                                    calibration_seqs=config.calibration_seqs)
    reference, served = built[ref], {c: built[c] for c in codecs}
    if config.get("exact_part", ""):
        served = exact_part_models(served, config.exact_part)
        codecs = list(served)
    bytes_per_token = {c: block_bytes(served[c], 16) / 16 for c in codecs}
    items = run_items(tok, config, model.config.max_position)
    p = config.passkey
    rows, timings, per_trial = [], [], {}
    for length, (wins, _, trials) in items.items():
        t0 = time.perf_counter()
        # no windows (windows=0): a passkey-only run, no quality numbers
        div = divergences(reference, served, wins, length - config.continuation,
                          batch_size=config.batch, chunk=config.chunk) if len(wins) else {}
        kl_s = time.perf_counter() - t0
        print(length, {c: round(d.kl, 5) for c, d in div.items()}, f"{kl_s:.0f}s",
              flush=True)
        for codec in codecs:
            t0 = time.perf_counter()
            pk = None if not trials else passkey_accuracy(
                served[codec], tok, trials, max_new_tokens=p.max_new_tokens,
                batch_size=p.batch, prefill_chunk=config.chunk, label=f"{codec}@{length}")
            pk_s = time.perf_counter() - t0
            d = div.get(codec)
            row = {"length": length, "codec": codec,
                   "kv_bytes_per_token": bytes_per_token[codec],
                   **{k: getattr(d, k) if d else None
                      for k in ("kl", "top1", "ppl", "ref_ppl")},
                   # no trials (passkey.trials=0): not measured, so no number
                   "passkey_acc": pk.accuracy if trials else None,
                   "passkey_tokens": int(np.mean([len(t.ids) for t in trials]))
                   if trials else None,
                   "kl_tokens": d.n_tokens if d else 0,
                   "window_kl": d.window_kl if d else [],
                   "window_top1": d.window_top1 if d else [], "passkey_s": pk_s}
            if trials:
                per_trial[f"{codec}@{length}"] = [
                    {"depth": t.depth, "key": t.key, "answer": a, "correct": ok}
                    for t, a, ok in zip(trials, pk.answers, pk.correct)]
            print({k: row[k] for k in COLUMNS}, f"passkey {pk_s:.0f}s", flush=True)
            rows.append(row)
        timings.append({"length": length, "windows": len(wins), "codecs": len(codecs),
                        "divergence_s": kl_s,
                        "divergence_s_per_window_per_model": kl_s / len(wins)
                        / (len(codecs) + 1) if len(wins) else None,
                        "passkey_s_per_trial": float(np.mean(
                            [r["passkey_s"] for r in rows if r["length"] == length]))
                        / len(trials) if trials else None})
    split = config.get("split", "test")
    notes = [f"{split} split: " + ("the pydoc dev half (6.7k tokens, read cyclically where "
                                   "longer: dev numbers choose settings, they are not "
                                   "results)" if split == "dev" else
                                   "the fresh stdlib-docstring test text, window starts "
                                   "spread evenly over it"),
             (f"kl / top1 / ppl: the last {config.continuation} tokens of {config.windows} "
              f"windows per length given the rest, prefilled through each codec's cache in "
              f"{config.chunk}-token pieces; kl = mean per-token KL({config.reference} KV "
              f"|| codec) in nats; ref_ppl: the {config.reference}-KV model's perplexity"
              if config.windows else "kl / top1 / ppl: not run (windows=0), no window "
              "scored"),
             (f"passkey_acc: {p.trials} trials per length ({p.template} prompt, "
              f"passkey_tokens on average, key at depths 0-100%), greedy, "
              f"{p.max_new_tokens} new tokens, the first number before a newline vs the key"
              if p.trials else "passkey: not run (passkey.trials=0), no prompts scored"),
             "calibrated codecs calibrated on "
             f"{config.calibration_seqs} x 256 tokens of the calibration split"]
    if config.get("exact_part", ""):
        notes.append(f"ablation (exact_part={config.exact_part!r}): every codec's "
                     f"{config.exact_part.upper()} kept in bfloat16, only the other half "
                     "coded; read through rebuilt K/V (research/kv/exact_part.py)")
    return common.Report(
        columns=COLUMNS, rows=rows, notes=notes,
        extra={"timings": timings, "passkey_trials": per_trial},
        tables=[{"title": "Cost per item (this machine)",
                 "columns": list(timings[0]), "rows": timings}],
        title="Long-context quality by KV codec: KL / top-1 vs bf16 KV, perplexity, passkey",
        plot=lambda fig: _plot(fig, rows, codecs))


def _plot(fig, rows, codecs):
    for i, (key, label) in enumerate((("kl", "KL(bf16 || codec), nats"),
                                      ("passkey_acc", "passkey accuracy"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for codec in codecs:
            sub = [r for r in rows if r["codec"] == codec and r[key] is not None]
            ax.plot([r["length"] for r in sub], [r[key] for r in sub], "o-", label=codec)
        ax.set_xscale("log", base=2)
        if key == "kl":
            ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
    fig.axes[-1].legend(fontsize=6)
