"""The PatchKV experiment's bookkeeping: pooled and per-context gap closed, claims."""
import math

import pytest

from experiments.patchkv import experiment as ex
from experiments.patchkv.patchkv import get_config


def _records(ppls):
    """Continuation records from {(context, compression, method): ppl}, 100 tokens each."""
    out = []
    for (ctx, comp, method), ppl in ppls.items():
        budget = 1.0 if comp == "full" else 0.1
        out.append({"kind": "continuation", "context": ctx, "compression": comp,
                    "budget": budget, "method": method, "nll_sum": 100 * math.log(ppl),
                    "n": 100, "attn_err": 0.0})
    return out


def test_gap_closed_pooled_and_per_context():
    records = _records({(0, "full", "full"): 20.0, (0, "snapkv", "none"): 22.0,
                        (0, "snapkv", "patchkv"): 21.0,
                        (1, "full", "full"): 30.0, (1, "snapkv", "none"): 31.0,
                        (1, "snapkv", "patchkv"): 31.0})
    per = ex.gap_closed_per_context(records)
    assert per["snapkv@0.1"] == pytest.approx([0.5, 0.0])
    rows = ex.aggregate(records)
    pooled = ex.gap_closed(rows, "snapkv", 0.1)
    # pooled over all tokens: geometric means of the per-context perplexities
    full, none, fixed = (math.sqrt(20 * 30), math.sqrt(22 * 31), math.sqrt(21 * 31))
    assert pooled == pytest.approx((none - fixed) / (none - full))
    claims = ex.claims(rows, get_config("small"), None)
    snap10 = [c for c in claims if c["claim"].startswith("snapkv@10%")]
    assert len(snap10) == 1 and snap10[0]["met"] == "no"  # pooled 37% < 50%


def test_claims_of_a_retrieval_only_run_score_retrieval_only():
    records = [{"kind": "retrieval", "context": 0, "compression": comp, "budget": budget,
                "method": method, "correct": correct, "asked": 4}
               for comp, budget, method, correct in [("full", 1.0, "full", 4),
                                                     ("snapkv", 0.1, "none", 1),
                                                     ("snapkv", 0.1, "patchkv", 2)]]
    claims = ex.claims(ex.aggregate(records), get_config("small"), None)
    assert [(c["claim"], c["met"]) for c in claims] == [
        ("snapkv@10%: PatchKV beats the unpatched press on retrieval", "yes")]


def test_dev_and_test_contexts_come_from_disjoint_text(tmp_path):
    from tests.patchkv.test_patchkv_tasks import CharTokenizer
    tok, config = CharTokenizer(), get_config("small")
    texts = {}
    for split in ("dev", "test"):
        config.split = split
        ids, token_range, _, name = ex.evaluation_ids(tok, config)
        assert token_range is None and split in name
        texts[split] = "".join(map(chr, ids))
    assert texts["dev"] and texts["test"] and texts["dev"][:500] not in texts["test"]
    path = tmp_path / "other.txt"
    path.write_text("".join(chr(97 + i % 26) for i in range(1000)))
    config.text_path = str(path)
    halves = {}
    for split in ("dev", "test"):
        config.split = split
        ids, token_range, n, name = ex.evaluation_ids(tok, config)
        assert name == str(path) and n == 1000 and len(ids) == 500
        halves[split] = token_range
    assert halves == {"dev": (0, 500), "test": (500, 1000)}


@pytest.mark.slow  # ~40 s; the patch modules' tests stay fast
def test_run_context_on_a_tiny_model_records_every_method_and_ablation():
    import jax
    import numpy as np
    from research.model import init_params, make_model, tiny_config
    from research.patchkv import tasks
    from research.patchkv.probes import ProbeConfig
    from research.patchkv.ridge import RidgeConfig
    from tqdm.auto import tqdm
    from research.tasq import TaSQConfig, tasq
    from research.transforms import CalibrationData, frozen
    mc = tiny_config(vocab_size=97, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96)
    model = make_model(mc, init_params(mc, jax.random.key(0)))
    other = CalibrationData.from_ids(np.random.default_rng(0).integers(0, 97, 4 * 64), 64, 4)
    quantizer = tasq(TaSQConfig(kmeans_iters=3, max_points=256, key_space="post_rope"))
    quantizers = {"tasq-1bit": frozen(quantizer, quantizer.calibrate(model, other))}
    ids = np.asarray(jax.random.randint(jax.random.key(1), (400,), 0, 97))
    task = tasks.continuation_tasks(ids, n_contexts=1, context_len=96, n_continuations=3,
                                    continuation_len=12)[0]
    config = get_config("small")
    config.compressions, config.budgets = ("snapkv",), (0.25,)
    config.ablations = ("rank64", "no_strength", "no_ffn")
    config.quantizer_query_scales = (1.2,)  # off by default; the option stays exercised
    records = []
    with tqdm(total=1, disable=True) as bar:
        ex.run_context("continuation", model, None, task, config,
                       ProbeConfig(n_generated=8, length=12), RidgeConfig(), quantizers,
                       records, bar, index=3)
    methods = [(r["compression"], r["method"]) for r in records]
    press_rows = [("snapkv", n) for m in map(ex.method_name, config.methods)
                  for n in ((m, m + "@bf16") if m.endswith("patchkv") else (m,))]
    assert methods == [("full", "full")] + press_rows + [
        ("tasq-1bit", "none"), ("tasq-1bit", "patchkv"),
        ("snapkv", "patchkv[rank64]"), ("snapkv", "patchkv[no_strength]"),
        ("snapkv", "patchkv[no_ffn]")]
    # bytes of real arrays: the bf16-stored patch is half the f32 one; totals add up
    by = {r["method"]: r for r in records if r["compression"] == "snapkv"}
    full = records[0]
    assert full["kv_bytes"] > by["none"]["kv_bytes"] > 0
    assert by["none"]["kv_bytes_bf16"] < by["none"]["kv_bytes"]
    if by["patchkv"]["patch_bytes"]:
        assert by["patchkv@bf16"]["patch_bytes"] * 2 == by["patchkv"]["patch_bytes"]
        even = ex.break_even([dict(r, context=0) for r in records])
        assert {e["storage"] for e in even} == {"f32", "bf16"}
        assert all(e["vs_full"] > 0 for e in even)
    records, tasq_rows = ([r for r in records if r["compression"] != "tasq-1bit"
                           and not r["method"].endswith("@bf16")],
                          [r for r in records if r["compression"] == "tasq-1bit"])
    # quantised caches: the W_q scale competes (eviction: none), budget = KV byte fraction
    assert min(abs(tasq_rows[1]["query_scale"] - t)
               for t in (1.0, *config.quantizer_query_scales)) < 1e-6
    assert tasq_rows[0]["query_scale"] is None and 0 < tasq_rows[0]["budget"] < 0.1
    assert all(r["context"] == 3 for r in records)
    by = {r["method"]: r for r in records}
    assert by["patchkv"]["strength"] in (0.0, *config.patch_strengths)
    assert by["patchkv"]["query_scale"] == 1.0
    assert by["patchkv[no_strength]"]["strength"] == 1.0 and by["none"]["strength"] is None
    # compositions: a patch over the baseline's refit cache, fit time of both counted
    for base in ("grkv", "am"):
        both = by[f"{base}+patchkv"]
        assert both["patch_bytes"] > 0 or both["strength"] == 0.0
        assert both["fit_s"] > 0 and both["strength"] is not None
    assert by["patchkv[rank64]"]["patch_bytes"] <= by["patchkv[no_strength]"]["patch_bytes"]
    # the config's W_down patch adds bytes over the W_o-only ablation (same probes)
    assert config.patch_ffn and (by["patchkv[no_ffn]"]["patch_bytes"]
                                 < by["patchkv[no_strength]"]["patch_bytes"])
    rows = ex.aggregate(records)
    assert set(ex.gap_closed_per_context(records)) == {"snapkv@0.25"}
    assert all(math.isfinite(r["ppl"]) for r in rows)


def test_chat_probes_override_the_probe_mix_and_add_the_templates_reply_prefix():
    from research.patchkv.probes import ProbeConfig
    from tests.patchkv.test_patchkv_tasks import CharTokenizer
    config = get_config("small")
    base = ProbeConfig(n_generated=8, length=48)
    default = ex.chat_probes(base, config, CharTokenizer())  # context repeats, no replies
    assert (default.n_repeat, default.n_text, default.n_reply) == (64, 0, 0)
    config.retrieval.probes = {"n_generated": 4, "n_reply": 4}
    cfg = ex.chat_probes(base, config, CharTokenizer())
    assert (cfg.n_generated, cfg.n_reply, cfg.length) == (4, 4, 48)
    assert "".join(map(chr, cfg.reply_prefix)) == "<|im_end|>\n<|im_start|>assistant\n"


def test_methods_are_step_tuples_with_patchkv_last():
    assert ex.check_method(["grkv", "patchkv"]) == ("grkv", "patchkv")
    assert ex.method_name(()) == "none" and ex.method_name(("am", "patchkv")) == "am+patchkv"
    with pytest.raises(TypeError, match="tuple of steps"):
        ex.check_method("grkv+patchkv")  # a name is not a method
    with pytest.raises(ValueError, match="unknown steps"):
        ex.check_method(("kvmerger",))
    with pytest.raises(ValueError, match="'patchkv' last"):
        ex.check_method(("patchkv", "grkv"))
    with pytest.raises(ValueError, match="not an eviction policy"):
        ex.press_transform("tasq-1bit", 0.1)
    config = get_config("small")
    assert all(ex.check_method(m) == m for m in config.methods)


def test_plot_draws_only_measured_metrics_against_the_bytes_held():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    config = get_config("small")
    config.compressions, config.methods = ("snapkv",), ((), ("patchkv",))
    rows = [{"compression": "full", "budget": 1.0, "method": "full", "ppl": 20.0,
             "total_MB": 180.0},
            {"compression": "snapkv", "budget": 0.1, "method": "none", "ppl": 23.0,
             "total_MB": 18.3},
            {"compression": "snapkv", "budget": 0.1, "method": "patchkv", "ppl": 21.5,
             "total_MB": 27.9},
            {"compression": "snapkv", "budget": 0.25, "method": "none", "ppl": 21.9,
             "total_MB": 45.7}]
    fig = plt.figure()
    ex.make_plot(rows, config)(fig)
    (ax,) = fig.axes  # no retrieval contexts: no empty retrieval panel
    assert ax.get_xlabel() == "kept KV + patch, MB (f32)"
    patched = [line for line in ax.get_lines() if line.get_label() == "snapkv/patchkv"]
    assert [tuple(line.get_xdata()) for line in patched] == [(27.9,)]
    rows[-1] = {k: v for k, v in rows[-1].items() if k != "total_MB"} | {"retrieval_acc": 0.5}
    fig = plt.figure()
    ex.make_plot(rows, config)(fig)
    assert len(fig.axes) == 2 and fig.axes[0].get_xlabel() == "fraction of context KV bytes kept"
    plt.close("all")


def test_gap_closed_is_undefined_where_the_press_does_not_raise_perplexity():
    # results/patchkv_4k_test_license: SnapKV 10% alone 22.07 < full 22.14; a ratio of
    # two negative-or-tiny differences (-134% there) says nothing about the patch
    records = _records({(0, "full", "full"): 22.14, (0, "snapkv", "none"): 22.07,
                        (0, "snapkv", "patchkv"): 21.98})
    rows = ex.aggregate(records)
    assert math.isnan(ex.gap_closed(rows, "snapkv", 0.1))
    (closed,) = [c for c in ex.claims(rows, get_config("small"), None)
                 if c["claim"].startswith("snapkv@10%")]
    assert closed["met"] == "n/a" and closed["measured"].startswith("undefined")
