"""Scale-out experiment (config and command: experiments/scaleout/scaleout.py)."""
from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common, protocol
from research import data
from research.core.timing import time_interleaved
from research.kv.paged import paged_kv_cache
from research.model import load
from research.decode.generate import decode_step, prefill
from research.serving import kv_codecs
from research.sharding import (LLAMA31_8B, SLICES, SMOLLM2_135M, collective_summary,
                               gathers_of, make_mesh, modeled_decode_step, modeled_layouts,
                               override_rules, per_device_bytes, shard_model)
from research.transforms import CalibrationData

# dev/test protocol declarations (experiments/protocol.py): nothing is tuned here; the
# equivalence checks compare a sharded run with one device on the same prompts
TECHNIQUE = "scaleout"
# the item ledger counts this run's test text as a workload, not as scored items:
# sharded == unsharded equivalence and throughput: no quality is scored
TEST_ITEMS_USE = "load"
DEFAULTS_CHOSEN_ON = "none: mesh layouts, prompts and sizes fixed a priori, not tuned"


def defaults(config) -> dict:
    return config.to_dict()


def test_items(config) -> list:
    """The held-out text the prompts are cut from, whole, as windows of 256 tokens (the
    item ledger, experiments/protocol.py; equivalence checks only, nothing is scored)."""
    tok = common.tokenizer_only(config.get("gguf_path", "") or None)
    return protocol.tiled_windows(tok.encode(data.corpus_text("heldout")), 256,
                                  "pydoc heldout")


COLUMNS = ["part", "kind", "model", "layout", "devices", "cache", "KV codes equal",
           "prefill max|err|",
           "decode max|err|", "max|logit|", "greedy identical", "params B/device", "KV B/device",
           "KV B total", "all-gathers of params/KV", "collectives/step",
           "decode tok/s", "prefill tok/s", "speedup", "step ms", "GB/chip", "fits",
           "bound"]


def _layout_name(d, t, e):
    parts = [f"{n}{k}" for n, k in (("dp", d), ("tp", t), ("ep", e)) if k > 1]
    return " x ".join(parts) or "dp1"


def _prompts(tokenizer, batch, length, seed):
    """`batch` windows of held-out text, lengths spread over [length/2, length]."""
    ids = np.asarray(tokenizer.encode(data.corpus_text("heldout")), np.int32)
    rng = np.random.default_rng(seed)
    tokens = np.zeros((batch, length), np.int32)
    lengths = rng.integers(length // 2, length + 1, batch).astype(np.int32)
    for b, s in enumerate(rng.integers(0, len(ids) - length, batch)):
        tokens[b, :lengths[b]] = ids[s:s + lengths[b]]
    return jnp.asarray(tokens), jnp.asarray(lengths)


def _greedy(model, tokens, lengths, n_steps, max_len, step_fn=None):
    """Prefill + n_steps greedy decode steps, each path feeding back its own argmax.
    Returns (tokens [B, n_steps + 1], logits list, final states, compiled step)."""
    b = tokens.shape[0]
    logits, states = prefill(model, tokens, lengths, model.init_cache(b, max_len))
    prompt_states = states  # decode steps do not donate: the prompt's cache stays readable
    out, toks, active = [np.asarray(logits)], [], jnp.ones((b,), bool)
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    step = step_fn or decode_step.lower(model, nxt, lengths, active, states).compile()
    for _ in range(n_steps):
        toks.append(np.asarray(nxt))
        logits, states = step(model, nxt, lengths, active, states)
        lengths = lengths + 1
        out.append(np.asarray(logits))
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    toks.append(np.asarray(nxt))
    return np.stack(toks, 1), out, states, step, prompt_states


def _code_agreement(ref_states, states) -> float | None:
    """Fraction of the prompt's integer KV codes (uint8 VQ codes) the sharded run wrote
    identically (a quantiser is discontinuous: a 1-ulp change of K/V can flip a code at
    a near-tie). None for float caches. Unwritten slots are zero in both and count."""
    same = total = 0
    for r, s in zip(ref_states, states):
        for name, a in r.items():
            if name == "block_table" or not np.issubdtype(np.asarray(a).dtype, np.integer):
                continue
            a, b = np.asarray(a), np.asarray(jax.device_get(s[name]))
            same += int((a == b).sum())
            total += a.size
    return same / total if total else None


def _compare(ref, got, sharded):
    ref_toks, ref_logits, _, _, ref_prompt = ref
    toks, logits, states, step, prompt_states = got
    same = int((toks == ref_toks).all(axis=1).sum())
    n_ok = next((i for i in range(toks.shape[1]) if (toks[:, i] != ref_toks[:, i]).any()),
                toks.shape[1])  # logits compared while both paths saw the same tokens
    errs = [float(np.max(np.abs(a - b))) for a, b in zip(logits[:n_ok + 1], ref_logits)]
    scale = max(float(np.max(np.abs(b))) for b in ref_logits)
    text = step.as_text()
    coll = collective_summary(text)
    codes = _code_agreement(ref_prompt, prompt_states)
    return {"KV codes equal": "" if codes is None else f"{codes:.6f}",
            "prefill max|err|": errs[0], "decode max|err|": max(errs[1:]) if errs[1:] else
            float("nan"), "max|logit|": scale, "greedy identical": f"{same}/{toks.shape[0]}",
            "params B/device": per_device_bytes(sharded.params)["max"],
            "KV B/device": per_device_bytes(states)["max"],
            "KV B total": per_device_bytes(states)["total"],
            "all-gathers of params/KV": len(gathers_of(text, sharded.params, states)),
            "collectives/step": ", ".join(f"{k} x{v['count']} ({v['bytes']:,} B)"
                                          for k, v in sorted(coll.items())) or "none"}


def _equivalence(config, model, tokenizer):
    c = config.equiv
    tokens, lengths = _prompts(tokenizer, c.batch, c.prompt_len, config.seed)
    max_len = c.prompt_len + c.decode_steps + 1
    variants = {}
    for name in c.caches:
        if name == "f32":
            variants[name] = model
        elif name == "paged":
            variants[name] = paged_kv_cache(block_size=c.paged_block_size).apply(model, None)
        elif name == "tasq":
            cal = CalibrationData.from_corpus(tokenizer, c.tasq_seq_len, c.tasq_n_seqs)
            variants[name] = kv_codecs.codec_model(  # the registry's TaSQ 1-bit codes
                model, "tasq-1bit", calibration=cal, seed=config.seed,
                options=dict(kmeans_iters=c.tasq_kmeans_iters))
        else:
            raise ValueError(f"unknown cache {name!r}")
    rows = []
    for name, m in variants.items():
        ref = _greedy(m, tokens, lengths, c.decode_steps, max_len)
        if c.batch_control:
            rows.append(_batch_control(m, tokens, lengths, ref, c.decode_steps, max_len))
            print(rows[-1], flush=True)
        for d, t, e in c.layouts:
            mesh = make_mesh(d, t, e)
            sharded = shard_model(m, mesh)
            got = _greedy(sharded, tokens, lengths, c.decode_steps, max_len)
            row = {"part": "equivalence", "kind": "measured", "model": "SmolLM2-135M",
                   "layout": _layout_name(d, t, e), "devices": d * t * e,
                   "cache": sharded.caches[0].inner.describe()}
            row.update(_compare(ref, got, sharded))
            rows.append(row)
            print(row, flush=True)
    return rows


def _batch_control(model, tokens, lengths, ref, n_steps, max_len):
    """The same single device with another batch composition: each row prefilled and
    decoded alone (batch 1), compared with the batch-`B` reference like a sharded run.
    XLA:CPU may sum in another order for another batch shape; where a discrete quantiser
    (TaSQ codes) flips on that, a mesh cannot be expected to do better."""
    ref_toks, ref_logits, _, _, ref_prompt = ref
    toks, errs, prompts, step = [], [0.0, 0.0], [], None
    for b in range(tokens.shape[0]):
        got = _greedy(model, tokens[b:b + 1], lengths[b:b + 1], n_steps, max_len, step)
        step = got[3]
        toks.append(got[0][0])
        n_ok = next((i for i in range(got[0].shape[1]) if got[0][0, i] != ref_toks[b, i]),
                    got[0].shape[1])
        for i, (a, r) in enumerate(zip(got[1][:n_ok + 1], ref_logits)):
            errs[min(i, 1)] = max(errs[min(i, 1)], float(np.max(np.abs(a[0] - r[b]))))
        prompts.append(got[4])
    # the rows' prompt states stacked back into one batch, compared like a sharded run's
    codes = _code_agreement(ref_prompt, jax.tree.map(
        lambda *rows: np.concatenate([np.asarray(r) for r in rows]), *prompts))
    same = int(sum((t == r).all() for t, r in zip(toks, ref_toks)))
    return {"part": "control", "kind": "measured", "model": "SmolLM2-135M",
            "layout": "dp1, rows one at a time", "devices": 1,
            "cache": model.caches[0].describe(),
            "KV codes equal": "" if codes is None else f"{codes:.6f}",
            "prefill max|err|": errs[0], "decode max|err|": errs[1],
            "max|logit|": max(float(np.max(np.abs(r))) for r in ref_logits),
            "greedy identical": f"{same}/{tokens.shape[0]}"}


def _moe(config):
    from research.moe import TrainConfig, train
    c = config.moe
    tc = TrainConfig(dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads,
                     n_kv_heads=c.n_kv_heads, n_experts=c.n_experts, top_k=c.top_k,
                     expert_ffn_dim=c.expert_ffn_dim, seq_len=c.seq_len,
                     batch_size=c.batch_size, steps=c.steps, warmup=c.warmup, lr=c.lr,
                     seed=config.seed, ckpt_every=c.steps)
    with tempfile.TemporaryDirectory() as ckpt:
        trained = train(tc, ckpt, progress=False)
    from research.moe import BOS, encode
    ids = encode(data.corpus_text("heldout"))
    rng = np.random.default_rng(config.seed)
    tokens = np.zeros((c.batch, c.prompt_len), np.int32)
    lengths = rng.integers(c.prompt_len // 2, c.prompt_len + 1, c.batch).astype(np.int32)
    for b, s in enumerate(rng.integers(0, len(ids) - c.prompt_len, c.batch)):
        tokens[b, 0] = BOS
        tokens[b, 1:lengths[b]] = ids[s:s + lengths[b] - 1]
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    max_len = c.prompt_len + c.decode_steps + 1
    ref = _greedy(trained.model, tokens, lengths, c.decode_steps, max_len)
    rows = []
    for d, t, e in c.layouts:
        sharded = shard_model(trained.model, make_mesh(d, t, e), override_rules(vocab=None),
                              moe_replica_slots=c.replica_slots)
        got = _greedy(sharded, tokens, lengths, c.decode_steps, max_len)
        row = {"part": "moe", "kind": "measured",
               "model": f"MoE LM ({c.n_experts} experts, top-{c.top_k}, trained "
                        f"{c.steps} steps, loss {trained.losses[-1]:.2f})",
               "layout": _layout_name(d, t, e), "devices": d * t * e,
               "cache": sharded.caches[0].inner.describe()}
        row.update(_compare(ref, got, sharded))
        rows.append(row)
        print(row, flush=True)
    return rows, trained.losses.tolist()


def _throughput(config, model, tokenizer):
    c = config.throughput
    tokens, lengths = _prompts(tokenizer, c.batch, c.prompt_len, config.seed + 1)
    active = jnp.ones((c.batch,), bool)
    fns, info = {}, {}
    for dp in c.data_parallel:
        sharded = shard_model(model, make_mesh(data=dp))
        states = sharded.init_cache(c.batch, c.max_len)
        pre = prefill.lower(sharded, tokens, lengths, states).compile()
        logits, states = pre(sharded, tokens, lengths, states)
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        step = decode_step.lower(sharded, nxt, lengths, active, states).compile()
        fns[("decode", dp)] = (lambda s=step, m=sharded, n=nxt, st=states:
                               s(m, n, lengths, active, st))
        fns[("prefill", dp)] = (lambda p=pre, m=sharded, st=states:
                                p(m, tokens, lengths, st))
        info[dp] = per_device_bytes(sharded.params)["max"]
    times = time_interleaved(fns, warmup=c.warmup, repeats=c.repeats, alternate=True)
    med = {k: statistics.median(v["wall_s"]) for k, v in times.items()}
    real_tokens = int(np.asarray(lengths).sum())
    rows = []
    for dp in c.data_parallel:
        rows.append({"part": "throughput", "kind": "measured (simulated devices, 2 shared "
                     "cores)", "model": "SmolLM2-135M", "layout": _layout_name(dp, 1, 1),
                     "devices": dp, "cache": f"f32 dense, batch {c.batch}",
                     "decode tok/s": c.batch / med[("decode", dp)],
                     "prefill tok/s": real_tokens / med[("prefill", dp)],
                     "speedup": med[("decode", c.data_parallel[0])] / med[("decode", dp)],
                     "step ms": med[("decode", dp)] * 1e3, "params B/device": info[dp]})
    return rows, {f"{k[0]}_dp{k[1]}": v for k, v in times.items()}


def _roofline(config):
    c = config.roofline
    models = {"SmolLM2-135M": SMOLLM2_135M, "Llama-3.1-8B": LLAMA31_8B}
    rows = []
    for slice_name in c.slices:
        chip, n = SLICES[slice_name]
        for mname in c.models:
            m = models[mname]
            base = modeled_decode_step(m, chip, 1, 1, c.batch, c.context, c.weight_bytes,
                                        c.kv_bytes)
            for dp, tp in [(1, 1)] + modeled_layouts(m, n):
                r = modeled_decode_step(m, chip, dp, tp, c.batch, c.context, c.weight_bytes,
                                         c.kv_bytes)
                rows.append({"part": f"roofline {slice_name}", "kind": "modeled",
                             "model": mname, "layout": _layout_name(dp, tp, 1),
                             "devices": dp * tp,
                             "cache": f"bf16 weights + KV, batch {c.batch} @ {c.context}",
                             "decode tok/s": r["tokens_per_s"],
                             "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                             "step ms": r["step_ms"],
                             "GB/chip": r["weights_GB_per_chip"] + r["kv_GB_per_chip"],
                             "fits": "yes" if r["fits"] else "no", "bound": r["bound"]})
    return rows


def run(config, out_dir: Path) -> common.Report:
    if jax.device_count() < 8:
        raise RuntimeError(f"needs 8 devices (config.host_devices=8), got {jax.device_count()}")
    unknown = set(config.parts) - {"equivalence", "moe", "throughput", "roofline"}
    if unknown:
        raise ValueError(f"config.parts has unknown parts {sorted(unknown)}")
    model, tokenizer = load()
    rows, moe_losses, times = [], None, None
    if "equivalence" in config.parts:
        rows += _equivalence(config, model, tokenizer)
    if "moe" in config.parts:
        moe_rows, moe_losses = _moe(config)
        rows += moe_rows
    if "throughput" in config.parts:
        tput_rows, times = _throughput(config, model, tokenizer)
        rows += tput_rows
    if "roofline" in config.parts:
        rows += _roofline(config)
    eq = [r for r in rows if r["part"] in ("equivalence", "moe")]
    controls = [r for r in rows if r["part"] == "control"]
    return _report(config, rows, _claims(eq, controls) if eq else [], moe_losses, times)


def _claims(eq, controls=()):
    floats = [r for r in eq if r["KV codes equal"] == ""]
    worst = max((max(r["prefill max|err|"], r["decode max|err|"]) / r["max|logit|"]
                 for r in floats), default=None)  # None: no float cache in this run
    codes = [float(r["KV codes equal"]) for r in eq if r["KV codes equal"] != ""]
    return [
        *([common.claim("sharded logits == single device (float caches: f32, paged f32)",
                        "max |err| / max |logit| <= 1e-5", worst, worst <= 1e-5)]
          if worst is not None else []),
        common.claim("TaSQ codes: sharded run writes the single-device codes",
                     "all but near-ties", min(codes) if codes else "n/a", None),
        common.claim("greedy generation identical", "every row, every layout",
                     ", ".join(r["greedy identical"] for r in eq),
                     all(r["greedy identical"].split("/")[0] == r["greedy identical"]
                         .split("/")[1] for r in eq)),
        *[common.claim(f"control: one device, rows one at a time, {r['cache']}",
                       "greedy identical to the same device at batch B (informative)",
                       f"{r['greedy identical']}, codes equal {r['KV codes equal'] or 'n/a'}",
                       None) for r in controls],
        common.claim("no parameter / KV all-gather in the decode step", "0",
                     sum(r["all-gathers of params/KV"] for r in eq),
                     sum(r["all-gathers of params/KV"] for r in eq) == 0),
    ]


def _report(config, rows, claims, moe_losses, times):
    notes = [
        "measured: equivalence, bytes (real arrays, per device), collectives (compiled "
        "HLO), throughput (medians of interleaved rounds, wall clock). The 8 devices are "
        "simulated by XLA on a 2-core CPU shared with other jobs: data parallelism there "
        "cannot speed anything up, the throughput rows show its overhead only.",
        "modeled: the roofline rows (research/sharding/roofline.py: datasheet peaks of TPU "
        "v5e and H200 SXM, 80% HBM / 60% FLOP / 80% link efficiency, ring all-reduces).",
        "SmolLM2 has 9 query / 3 KV heads: tensor parallelism is 1 or 3 (dp2 x tp3 uses 6 "
        "of 8 devices); 8 devices run it data-parallel.",
    ]

    tput = [r for r in rows if r["part"] == "throughput"]
    modeled = [r for r in rows if r["kind"] == "modeled"]

    coded = [r for r in rows if r["part"] in ("equivalence", "control")
             and r.get("KV codes equal")]

    def plot(fig):
        panels = int(bool(tput)) + int(bool(modeled)) + int(bool(coded) and not
                                                            (tput or modeled))
        if not panels:
            return
        axes = iter(fig.subplots(1, panels, squeeze=False)[0])
        if coded and not (tput or modeled):  # an equivalence-only run: codes written alike
            ax = next(axes)
            ax.bar([r["layout"] for r in coded],
                   [100 * float(r["KV codes equal"]) for r in coded])
            ax.set_xlabel("layout (vs one device at batch B)")
            ax.set_ylabel("KV codes written identically (%)")
            ax.set_ylim(95, 100)
            ax.set_title("measured, TaSQ codes", fontsize=9)
        if tput:
            ax = next(axes)
            ax.bar([str(r["devices"]) for r in tput], [r["decode tok/s"] for r in tput])
            ax.set_xlabel("data-parallel simulated devices (2 shared cores)")
            ax.set_ylabel("decode tok/s (measured)")
            ax.set_title("measured, CPU", fontsize=9)
        if modeled:
            ax = next(axes)
            for key in sorted({(r["part"], r["model"]) for r in modeled}):
                pts = [r for r in modeled if (r["part"], r["model"]) == key]
                ax.plot([r["devices"] for r in pts], [r["speedup"] for r in pts], "o",
                        label=f"{key[0].split()[-1]} {key[1]}")
            ax.set_xlabel("chips")
            ax.set_ylabel("decode speedup vs 1 chip (modeled)")
            ax.set_title("modeled, roofline", fontsize=9)
            ax.legend(fontsize=6)

    columns = [c for c in COLUMNS if any(c in r for r in rows)]
    return common.Report(
        columns=columns, rows=rows, title="Scale-out: sharded SmolLM2 / MoE LM on a mesh",
        claims=claims, notes=notes, plot=plot,
        extra={"parts": list(config.parts), "throughput_times": times,
               "moe_train_losses": moe_losses,
               "roofline_chips": {k: dataclasses.asdict(v[0]) for k, v in
                                  SLICES.items()}})
