"""TaSQ experiment (see tasq.py for the command): codecs, ablation, memory, decode speed."""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import common, protocol
from kernels_pallas.vq_attention import vq_decode_attention_reference
from research import data
from research.eval.perplexity import perplexity, windows
from research.kv import memory
from research.kv.codec import FloatCodec
from research.kv.dense import DenseKVCache
from research.model import load
from research.core.attention import attend
from research.core.timing import time_interleaved
from research.tasq import (CQCodec, TaSQConfig, attention_output_error, bits_per_channel,
                           cache_param_bytes, cq_style, int8_kv, kivi_kv,
                           max_batch_with_codebooks, plain_vq, sign_kv, tasq)
from research.model.precision import kv_cache_dtype
from research.transforms import CalibrationData, calibrate_and_apply, chain

# the dev/test protocol (experiments/protocol.py)
TECHNIQUE = "tasq"
DEFAULTS_CHOSEN_ON = "python -m experiments.run --config=experiments/tasq/tasq.py:dev"


def defaults(config) -> dict:
    """The TaSQ settings this run's TaSQ rows use: the library defaults (TaSQConfig, the
    key space among them) with the config's k-means budget and seed (`variants`), so the
    ledger records what ran (the small config's 10 iterations on 4,096 points, not the
    library's 12 on 8,192)."""
    cfg = TaSQConfig(kmeans_iters=config.tasq.kmeans_iters,
                     max_points=config.tasq.max_points, seed=config.seed)
    return {k: v for k, v in cfg.to_dict().items()
            if k not in ("implementation", "interpret")}


def test_items(config) -> list:
    """The perplexity windows and attention-error sequences this run scores (the item
    ledger, experiments/protocol.py)."""
    tok = common.tokenizer_only(config.gguf_path or None)
    ids = tok.encode(data.split_text(config.split, config.get("test_text", "pydoc")))
    p, a = config.ppl, config.attn_error
    spans = [(w.begin, w.end) for w in windows(len(ids), p.window, p.stride)
             [:p.max_windows]]
    spans += [(i * a.seq_len, (i + 1) * a.seq_len) for i in range(a.n_seqs)]
    return protocol.text_windows(ids, list(dict.fromkeys(spans)),
                                 text_name(config))


def text_name(config) -> str:
    """The scored text: a pydoc half, or the fresh stdlib-docstring test text."""
    if config.get("test_text", "pydoc") == "stdlib":
        return "fresh stdlib-docstring test text"
    return f"pydoc {config.split} half"


def prior_scorings() -> list[dict]:
    """Test scorings before the item ledger (issue 36), for `protocol.seed_history`."""
    return [{"label": "issue36:tasq-preprotocol-heldout", "count": 1, "reason": (
        "issue 36: the pre-protocol run that led to pre-RoPE keys scored the first 8 x 256 "
        "tokens of the held-out text (its test-topic paragraphs open the test half)"),
        "items": protocol.heldout_windows([(i * 256, (i + 1) * 256) for i in range(8)])}]


BF16 = "bf16"
TASQ_POST = "TaSQ (1 bit, post-RoPE keys)"
TASQ_PRE = "TaSQ (1 bit, pre-RoPE keys)"
KEY_SPACE_ROWS = {"post_rope": TASQ_POST, "pre_rope": TASQ_PRE}


def default_row() -> str:
    """The row of TaSQ's default configuration (TaSQConfig().key_space)."""
    return KEY_SPACE_ROWS[TaSQConfig().key_space]
# decode-attention timing: (key, label, plot style); "1bit" reads TaSQ's post-RoPE codes
# through lookup tables, "1bit_pre" TaSQ's pre-RoPE codes (two-pass: block scores, bins)
TIMED = (("bf16", "bf16 dense", "o-"), ("1bit", "1-bit post-RoPE (LUT)", "s-"),
         ("1bit_pre", "1-bit pre-RoPE (two-pass)", "^-"))


def variants(config) -> list[tuple[str, str, object]]:
    """(name, role, transform) for every row of the table."""
    km = dict(kmeans_iters=config.tasq.kmeans_iters, max_points=config.tasq.max_points,
              seed=config.seed)
    full = TaSQConfig(bits=1, key_space="post_rope", **km)
    abl = lambda **ch: tasq(dataclasses.replace(full, **ch))  # noqa: E731
    k = config.kivi
    if config.split == "dev":  # the key-space choice: the two candidates and f32 only
        return [("f32", "reference", chain()), (TASQ_POST, "tasq", tasq(full)),
                (TASQ_PRE, "tasq", abl(key_space="pre_rope"))]
    rows = [
        ("f32", "reference", chain()),
        (BF16, "baseline", kv_cache_dtype("bfloat16")),
        ("int8 per-token", "baseline", int8_kv()),
        ("KIVI-2 (fp window)", "baseline", kivi_kv(2, k.key_group, k.value_group, k.residual)),
        ("sign-bit (QJL-like keys)", "baseline 1-bit", sign_kv(config.seed)),
        ("plain VQ", "baseline 1-bit", plain_vq(1, **km)),
        ("CQ-style (pre-RoPE)", "baseline 1-bit", cq_style(1, km["kmeans_iters"],
                                                            km["max_points"], config.seed)),
        (TASQ_POST, "tasq", tasq(full)),
        ("TaSQ post-RoPE - query weighting", "ablation", abl(query_weighting=False)),
        ("TaSQ post-RoPE - channel grouping", "ablation", abl(channel_grouping=False)),
        ("TaSQ post-RoPE - head normalization", "ablation", abl(head_normalization=False)),
        ("TaSQ post-RoPE shared codebooks", "ablation", abl(share_codebooks=True)),
        ("TaSQ post-RoPE shared codebooks - head norm", "ablation",
         abl(share_codebooks=True, head_normalization=False)),
        # 2 bits in the default key space
        ("TaSQ (2 bits)", "tasq", tasq(TaSQConfig(bits=2, **km))),
        # the same ingredients on pre-RoPE keys (CQ's key space, blockwise read)
        (TASQ_PRE, "tasq", abl(key_space="pre_rope")),
        ("TaSQ pre-RoPE - query weighting", "ablation",
         abl(key_space="pre_rope", query_weighting=False)),
        ("TaSQ pre-RoPE - channel grouping", "ablation",
         abl(key_space="pre_rope", channel_grouping=False)),
    ]
    only = tuple(config.get("rows", ()))
    unknown = set(only) - {r[0] for r in rows}
    if unknown:
        raise ValueError(f"config.rows: unknown rows {sorted(unknown)}; expected names from "
                         f"{[r[0] for r in rows]}")
    return [r for r in rows if not only or r[0] in only]


def measure_variant(model, transform, cal, held_ids, attn_tokens, config) -> dict:
    t0 = time.perf_counter()
    m, _ = calibrate_and_apply(transform, model, cal)
    calib_s = time.perf_counter() - t0
    p = config.ppl
    ppl = perplexity(m, held_ids, window=p.window, stride=p.stride, batch_size=p.batch_size,
                     max_windows=p.max_windows)
    err = attention_output_error(m, attn_tokens)
    ctx, budget = config.memory.context, int(config.memory.budget_gib * memory.GiB)
    return {"bits/ch": bits_per_channel(m, ctx),
            "codebook KiB": cache_param_bytes(m) / 1024,
            "KV B/token": memory.kv_bytes_per_token(m, ctx),
            "max batch": max_batch_with_codebooks(m, budget, ctx),
            "perplexity": ppl.ppl, "attn err": err["mean"], "calib s": calib_s,
            "_per_layer_err": err["per_layer"], "_model": m}


# -- decode-attention timing ------------------------------------------------------------------

def _dense_decode(q, k, v, lengths):
    """The bf16 path: core masked GQA attention over a dense bf16 cache (one query)."""
    b, s = k.shape[:2]
    kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    return attend(q[:, None], k, v, (lengths - 1)[:, None], kv_pos,
                  kv_pos < lengths[:, None])[:, 0]


def _code_reader(cache):
    """Decode-attention read of `cache`'s codes (XLA): lookup tables for post-RoPE codes, the
    two-pass block-score path for pre-RoPE codes (CQCodec)."""
    if isinstance(cache, CQCodec):
        head_dim = cache.key_codebook.shape[1] * cache.key_codebook.shape[3]
        read = functools.partial(vq_decode_attention_reference,
                                 key_rope=cache.key_rope(head_dim),
                                 block=cache.block)
    else:
        read = vq_decode_attention_reference
    return jax.jit(lambda q, kc, vc, n: read(q, kc, vc, cache.key_codebook,
                                             cache.value_codebook, n))


def time_decode(caches: dict, model_config, context: int, batch: int, warmup: int,
                repeats: int, seed: int) -> dict:
    """Median seconds of one decode query's attention over `context` cached tokens, read
    from (a) dense bf16 K/V and (b) the 1-bit codes of each cache in `caches` (name ->
    layer cache); plus a full decode step (encode + write + attend) of each with the state
    donated. Keys `<name>_ms`, `<name>_speedup` (bf16 time / its time), `<name>_step_ms`."""
    c = model_config
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, c.n_heads, c.head_dim)), jnp.float32)
    kv_shape = (batch, context, c.n_kv_heads, c.head_dim)
    k = jnp.asarray(rng.normal(size=kv_shape), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=kv_shape), jnp.bfloat16)
    g = next(iter(caches.values())).key_codebook.shape[1]
    codes = (batch, context, c.n_kv_heads, g)
    kc = jnp.asarray(rng.integers(0, 256, codes), jnp.uint8)
    vc = jnp.asarray(rng.integers(0, 256, codes), jnp.uint8)
    lengths = jnp.full((batch,), context, jnp.int32)
    dense_fn = jax.jit(_dense_decode)
    reads = {"bf16": lambda: dense_fn(q, k, v, lengths)}
    steps = {"bf16": _decode_step(DenseKVCache(FloatCodec("bfloat16")), {"k": k, "v": v}, c,
                                  batch, context, rng)}
    for name, cache in caches.items():
        fn = _code_reader(cache)
        reads[name] = lambda fn=fn: fn(q, kc, vc, lengths)
        steps[name] = _decode_step(DenseKVCache(cache), {"k_codes": kc, "v_codes": vc}, c, batch, context, rng)
    read = interleaved_medians(reads, warmup, repeats)
    step = interleaved_medians(steps, warmup, repeats)
    out = {"context": context, "bf16_bytes": int(k.nbytes + v.nbytes),
           "1bit_bytes": int(kc.nbytes + vc.nbytes)}
    for name in reads:
        out[f"{name}_ms"] = read[name] * 1e3
        out[f"{name}_step_ms"] = step[name] * 1e3
        out[f"{name}_speedup"] = read["bf16"] / read[name]
        out[f"{name}_step_speedup"] = step["bf16"] / step[name]
    return out


def interleaved_medians(fns: dict, warmup: int, repeats: int) -> dict:
    """Median seconds of each fn, timed in alternation (A, B, A, B, ...) after warm-up, so a
    shared machine's load drifts hit both sides alike."""
    times = time_interleaved(fns, warmup=warmup, repeats=repeats)
    return {name: float(np.median(t["wall_s"])) for name, t in times.items()}


def _decode_step(cache, state, c, batch, context, rng):
    """A callable running update_and_attend for one new token with the cache state donated
    (as in a decode loop), so neither path pays for copying its state."""
    q = jnp.asarray(rng.normal(size=(batch, 1, c.n_heads, c.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(batch, 1, c.n_kv_heads, c.head_dim)), jnp.float32)
    start = jnp.full((batch,), context - 1, jnp.int32)
    one = jnp.ones((batch,), jnp.int32)
    fn = jax.jit(lambda s: cache.update_and_attend(s, q, kv, kv, start=start, n_new=one,
                                                   window=None), donate_argnums=0)
    box = [jax.tree.map(jnp.copy, state)]

    def call():
        out, box[0] = fn(box[0])
        return out

    return call


# -- report -------------------------------------------------------------------------------------

ROLE_COLORS = {"reference": "gray", "baseline": "tab:blue", "baseline 1-bit": "tab:orange",
               "tasq": "tab:green", "ablation": "tab:olive"}


def _plot(rows, timing):
    """Left: perplexity per codec as labelled bars (one row each, no overlapping point
    labels); right: decode attention time against context."""
    def draw(fig):
        from matplotlib.patches import Patch
        fig.set_size_inches(12, 6.5)
        ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
        f32 = rows[0]["perplexity"]
        y = np.arange(len(rows))
        ax1.barh(y, [r["perplexity"] for r in rows],
                 color=[ROLE_COLORS.get(r["role"], "tab:purple") for r in rows])
        ax1.set_yticks(y, [f"{r['codec']}  [{r['bits/ch']:.3g} b/ch]" for r in rows],
                       fontsize=8)
        ax1.invert_yaxis()
        ax1.axvline(f32, color="gray", ls="--", lw=1)
        for yi, r in zip(y, rows):
            ax1.text(r["perplexity"] * 1.05, yi, f"{r['perplexity']:.4g}", va="center",
                     fontsize=7)
        ax1.set_xscale("log")
        ax1.set_xlim(10, max(r["perplexity"] for r in rows) * 4)
        ax1.set_xlabel("held-out perplexity (log; dashed: f32)", fontsize=9)
        ax1.set_ylabel("codec  [bits per channel, all overhead]", fontsize=9)
        ax1.tick_params(axis="x", labelsize=8)
        ax1.legend(handles=[Patch(color=c, label=role)
                            for role, c in ROLE_COLORS.items()],
                   fontsize=7, loc="lower right")
        ctx = [t["context"] for t in timing]
        for name, label, style in TIMED:
            ax2.plot(ctx, [t[f"{name}_ms"] for t in timing], style, label=label)
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(ctx, [f"{c // 1024}k" for c in ctx], fontsize=8)
        ax2.minorticks_off()
        ax2.tick_params(axis="y", labelsize=8)
        ax2.set_xlabel("context (tokens)", fontsize=9)
        ax2.set_ylabel("decode attention, ms (median)", fontsize=9)
        ax2.legend(fontsize=8)
        ax2.set_title(f"CPU XLA ({jax.default_backend()}), batch 1", fontsize=9)
    return draw


def _claims(rows, timing, config) -> list[dict]:
    by = {r["codec"]: r for r in rows}
    t, bf = by[default_row()], by[BF16]
    ratio = t["max batch"] / bf["max batch"]
    claims = [common.claim(f"max batch vs bf16 at 1 bit ({config.memory.context} ctx, "
                           f"{config.memory.budget_gib:g} GiB)", ">= 14x", f"{ratio:.2f}x",
                           ratio >= 14)]
    for mine in (default_row(), *(r for r in KEY_SPACE_ROWS.values() if r != default_row())):
        t = by[mine]
        tag = " (the default)" if mine == default_row() else " (not the default)"
        for other in ("plain VQ", "CQ-style (pre-RoPE)", "sign-bit (QJL-like keys)"):
            o = by[other]
            claims.append(common.claim(
                f"{mine}{tag} ppl gap < {other}",
                f"< {o['ppl gap %']:.1f}% (at {o['bits/ch']:.2f} b/ch)",
                f"{t['ppl gap %']:.1f}% (at {t['bits/ch']:.2f} b/ch)",
                t["ppl gap %"] < o["ppl gap %"]))
    ablations = {TASQ_POST: ("TaSQ post-RoPE - query weighting",
                             "TaSQ post-RoPE - channel grouping",
                             "TaSQ post-RoPE - head normalization",
                             "TaSQ post-RoPE shared codebooks"),
                 TASQ_PRE: ("TaSQ pre-RoPE - query weighting",
                            "TaSQ pre-RoPE - channel grouping")}
    for mine, names in ablations.items():
        t = by[mine]
        for name in (n for n in names if n in by):  # (ablation rows only where run)
            a = by[name]
            claims.append(common.claim(f"ablation: {name}", "gap rises without it",
                                       f"{a['ppl gap %']:.1f}% vs {t['ppl gap %']:.1f}%; "
                                       f"attn err {a['attn err']:.3f} vs "
                                       f"{t['attn err']:.3f}", None))
    last = timing[-1]
    for name, label, _ in sorted(TIMED[1:], key=lambda x: x[0] != DEFAULT_TIMED()):
        x = last[f"{name}_speedup"]
        tag = " (the default)" if name == DEFAULT_TIMED() else ""
        claims.append(common.claim(f"{label}{tag} decode attention vs bf16 at "
                                   f"{last['context']} ctx (CPU)", ">= 2x faster",
                                   f"{x:.2f}x", x >= 2))
    return claims


def DEFAULT_TIMED() -> str:  # noqa: N802 - a constant of the current default
    return "1bit" if TaSQConfig().key_space == "post_rope" else "1bit_pre"


def _dev_claims(rows) -> list[dict]:
    by = {r["codec"]: r for r in rows}
    post, pre = by[TASQ_POST]["ppl gap %"], by[TASQ_PRE]["ppl gap %"]
    winner = "pre_rope" if pre < post else "post_rope"
    return [common.claim("dev: the key space with the smaller perplexity gap becomes "
                         "TaSQConfig's default", f"default == {winner!r}",
                         f"post-RoPE {post:+.1f}%, pre-RoPE {pre:+.1f}%; default "
                         f"{TaSQConfig().key_space!r}", TaSQConfig().key_space == winner)]


def run(config, out_dir=None) -> common.Report:
    model, tok = load(config.gguf_path or None)
    # dev: the key-space choice; test: every row, scored once with the final defaults
    held_ids = tok.encode(data.split_text(config.split, config.get("test_text", "pydoc")))
    cal = CalibrationData.from_corpus(tok, config.calibration.seq_len,
                                      config.calibration.n_seqs)
    a = config.attn_error
    attn_tokens = np.asarray(held_ids[:a.n_seqs * a.seq_len], np.int32).reshape(a.n_seqs,
                                                                                 a.seq_len)
    rows, per_layer, timed_caches = [], {}, {}
    for name, role, transform in tqdm(variants(config), desc="codecs"):
        r = measure_variant(model, transform, cal, held_ids, attn_tokens, config)
        per_layer[name] = r.pop("_per_layer_err")
        m = r.pop("_model")
        if name in (TASQ_POST, TASQ_PRE):
            timed_caches["1bit" if name == TASQ_POST else "1bit_pre"] = m.caches[0].codec
        rows.append({"codec": name, "role": role,
                     "default": "yes" if name == default_row() else "", **r})
    f32 = rows[0]["perplexity"]
    bf = next((r for r in rows if r["codec"] == BF16), None)  # (not in the dev run)
    for r in rows:
        r["ppl gap %"] = 100 * (r["perplexity"] / f32 - 1)
        r["x batch vs bf16"] = r["max batch"] / bf["max batch"] if bf else float("nan")
    tm = config.timing
    timing = []
    if config.split != "dev":
        with common.bench_lock():  # only the timed section holds the machine's bench lock
            timing = [time_decode(timed_caches, model.config, ctx, tm.batch, tm.warmup,
                                  tm.repeats, config.seed)
                      for ctx in tqdm(tm.contexts, desc="timing")]
    columns = ["codec", "role", "default", "bits/ch", "KV B/token", "codebook KiB", "max batch",
               "x batch vs bf16", "perplexity", "ppl gap %", "attn err", "calib s"]
    timing_lines = [
        f"ctx {t['context']} (bytes {t['bf16_bytes']} vs {t['1bit_bytes']}): " + ", ".join(
            f"{label} {t[name + '_ms']:.2f} ms ({t[name + '_speedup']:.2f}x; full decode "
            f"step {t[name + '_step_ms']:.2f} ms, {t[name + '_step_speedup']:.2f}x)"
            for name, label, _ in TIMED) for t in timing]
    notes = [
        f"{text_name(config)} (research/data.py), {len(held_ids)} tokens (perplexity: {config.ppl.max_windows} windows "
        f"of {config.ppl.window}, stride {config.ppl.stride}); calibration "
        f"{config.calibration.n_seqs}x{config.calibration.seq_len} tokens of the calibration "
        "split only",
        "bits/ch and KV B/token: bytes of the real cache state arrays (eval_shape of "
        f"init_cache) at {config.memory.context} context, per K/V channel, all per-token and "
        "per-block scales and KIVI's full-precision ring included; codebooks/permutations/"
        "projections (cache leaves) are reported separately (codebook KiB) and subtracted "
        f"from the {config.memory.budget_gib:g} GiB budget before max batch is computed",
        "attn err: relative error of each layer's attention output after W_o when that "
        f"layer's K/V go through the codec (exact q/k/v fed in), mean over layers, "
        f"{a.n_seqs}x{a.seq_len} held-out tokens",
        "sign-bit: QJL-style 1-bit key sketch (m = head_dim Gaussian projections + f16 norm) "
        "and 1-bit sign values with an f16 scale per token; CQ-style: adjacent 8-channel "
        "groups, pre-RoPE keys, per-head plain k-means, keys rebuilt and rotated one block "
        "at a time on read (as TaSQ pre-RoPE); plain "
        "VQ = the same codec as TaSQ on raw post-RoPE K/V with adjacent groups",
        "perplexity prefills each window through the cache, so every codec is read back "
        "for every token (KIVI: positions within `residual` of the query read full "
        "precision)",
        "decode attention timing (same process, medians after warm-up, batch "
        f"{tm.batch}, SmolLM2 layer shapes, TaSQ layer-0 codebooks; x = bf16 time / this "
        "time; full decode step = encode + write + attend with the state donated): "
        + "; ".join(timing_lines),
    ]
    return common.Report(columns=columns, rows=rows,
                         title="TaSQ: 1-bit VQ KV cache vs alternatives, SmolLM2-135M-Instruct",
                         claims=(_dev_claims(rows) if config.split == "dev"
                                 else _claims(rows, timing, config)),
                         extra={"timing": timing, "attn_err_per_layer": per_layer},
                         plot=_plot(rows, timing), notes=notes)
