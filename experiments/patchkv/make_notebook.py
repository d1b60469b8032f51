"""Writes notebooks/patchkv.ipynb from the cells below (keeps the notebook reviewable).

    python experiments/patchkv/make_notebook.py
"""
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell

from experiments.notebook_cells import INSTALL, write_default, write_notebook


CELLS = [
    new_markdown_cell(
        "# PatchKV: a ridge weight patch that recovers what KV eviction lost\n\n"
        "One context, many queries: the context is prefilled once into a *compressed* KV "
        "cache (here SnapKV keeps 10% of it). PatchKV then fits, once per context and in "
        "closed form, a patch `Delta` of every layer's output projection so that attention "
        "over the compressed cache, times `W_o + Delta`, matches attention over the full "
        "cache on probe queries, then a patch of every FFN's `W_down` for what is left of "
        "the layer's output mismatch. The patched model has the same shapes and FLOPs per "
        "query. The full comparison (presses x budgets x baselines) is "
        "`python -m experiments.run --config=experiments/patchkv/patchkv.py:small`."),
    new_code_cell(INSTALL),
    new_code_cell(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from research import data\n"
        "from research.model import load\n"
        "model, tokenizer = load()\n"
        "ids = tokenizer.encode(data.corpus_text('heldout'))  # never calibrated on\n"
        "calib_ids = np.array(tokenizer.encode(data.corpus_text('calibration')))\n"
        "context, continuations = np.array(ids[:256]), np.array(ids[256:320]).reshape(2, 32)\n"
        "print(len(ids), 'held-out tokens; context', len(context), 'tokens')"),
    new_markdown_cell(
        "## Eviction is a cache\n`evict(policy, ratio)` is a Transform that swaps every "
        "dense layer's cache for an `EvictingKVCache`: the context attends to itself in "
        "full during prefill, then only `ceil(ratio * n)` tokens per KV head are kept "
        "(`streaming_llm`, `h2o`, `snapkv`, `random`, `knorm`). Later chunks append."),
    new_code_cell(
        "from research.kv.base import state_nbytes\n"
        "from research.eviction import evict, kept_tokens, trim_states\n"
        "from research.patchkv import prefill_context\n"
        "compressed = evict('snapkv', 0.1).apply(model, ())\n"
        "max_len = len(context) + 64\n"
        "ctx = prefill_context(compressed, context, max_len)\n"
        "print(compressed.caches[0].describe(), 'kept per layer:',\n"
        "      int(kept_tokens(ctx.states[0])[0]), 'of', len(context))\n"
        "print('context KV bytes, trimmed to the kept slots:',\n"
        "      state_nbytes(trim_states(ctx.states, room=0)))"),
    new_markdown_cell(
        "## Fit the patch: `chain(evict(...), patchkv(...))`\nThe calibration data is the "
        "context itself. Probe rows follow it: here spans of real text from the calibration "
        "split (`n_text`; sampled continuations of the full-cache model, `n_generated`, and "
        "re-fed spans of the context, `n_repeat`, are the other kinds). Lambda is chosen "
        "per layer on held-out probe rows (the zero patch competes, so a layer that does not "
        "gain stays unpatched); `ffn=True` adds the W_down patch after each layer's W_o "
        "patch. `strengths` then scales the whole patch by the factor with the least "
        "KL(full-cache model || patched model) on the held-out rows, 0 included: the "
        "per-layer fits see activations, this check sees next-token distributions."),
    new_code_cell(
        "from research.patchkv import (ProbeConfig, attention_error, decode_flops,\n"
        "                              param_shapes, patch_nbytes, patchkv, reference_model,\n"
        "                              score_continuations, summarize)\n"
        "from research.transforms import CalibrationData, calibrate_and_apply, chain\n"
        "t = chain(evict('snapkv', 0.1), patchkv(\n"
        "    probes=ProbeConfig(n_generated=0, n_text=8, length=32), probe_text=calib_ids,\n"
        "    ffn=True, strengths=(0.5, 1.0, 1.5)))\n"
        "calib = CalibrationData.from_context(context)\n"
        "patched, (_, pstate) = calibrate_and_apply(t, model, calib)\n"
        "print(t.name)\n"
        "print({k: round(v, 3) if isinstance(v, float) else v\n"
        "       for k, v in summarize(pstate).items()})"),
    new_markdown_cell(
        "On a quantised cache the same transform chains after the quantizer: "
        "`chain(frozen_tasq, patchkv(...))`. Optionally `query_scales="
        "DEV_QUERY_SCALES` first lets one W_q scale per query head (a logit "
        "temperature, folded into the weight) compete on the same held-out KL: a 1-bit key "
        "codebook flattens attention, which no map of the attention output can sharpen "
        "back (the experiment leaves it off: the text rows and the W_down patch did better "
        "on its dev split)."),
    new_markdown_cell(
        "## Many queries over one compressed context\nThe compressed cache was built by the "
        "unpatched model; every query is served by the patched one over that cache."),
    new_code_cell(
        "ref = reference_model(model)\n"
        "full = score_continuations(ref, prefill_context(ref, context, max_len),\n"
        "                           continuations, attention=True)\n"
        "for name, m in [('no patch', compressed), ('PatchKV', patched)]:\n"
        "    s = score_continuations(m, ctx, continuations, attention=True)\n"
        "    print(f'{name:9s} ppl {np.exp(s.nll):7.2f}  attention error '\n"
        "          f'{attention_error(s.attn_contrib, full.attn_contrib):.3f}')\n"
        "print(f'full cache ppl {np.exp(full.nll):7.2f}')"),
    new_markdown_cell("## Zero per-query overhead: same parameter shapes, same decode FLOPs"),
    new_code_cell(
        "print('same shapes:', param_shapes(patched) == param_shapes(compressed))\n"
        "# XLA cost analysis of the compiled decode step over this context's cache\n"
        "flops = [decode_flops(m, ctx.states, [len(context)])\n"
        "         for m in (compressed, patched)]\n"
        "print('decode-step FLOPs (unpatched, patched):', flops)\n"
        "print('patch memory (MB, dense f32):', patch_nbytes(pstate) / 2**20)"),
    new_markdown_cell(
        "## The experiment's table and plot, at notebook scale\n"
        "`experiments.patchkv.experiment.run` is what `python -m experiments.run` calls. "
        "Here it runs on a reduced config: one 256-token continuation context (4 "
        "continuations of 32 tokens) and one retrieval context with 3 facts, SnapKV and "
        "StreamingLLM at 10 / 25 / 50%, no patch vs PatchKV vs the GRKV-style ridge merge "
        "vs the Attention-Matching-style value fit, 32 text probe rows (the retrieval "
        "context: 64 context repeats, `cfg.retrieval.probes`), W_o patches only. One small "
        "context is noisy, and retrieval gains need the W_down patch: the README reports "
        "the `small` run (two 512-token contexts, W_o + W_down)."),
    new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "from IPython.display import Markdown, display\n"
        "from experiments import common\n"
        "from experiments.patchkv import experiment\n"
        "from experiments.patchkv.patchkv import get_config\n"
        "cfg = get_config('small')\n"
        "cfg.budgets, cfg.methods = (0.1, 0.25, 0.5), ((), ('patchkv',), ('grkv',), ('am',))\n"
        "cfg.quantizers, cfg.ablations, cfg.check_flops = (), (), False  # FLOPs: above\n"
        "cfg.continuation.update(n_contexts=1, context_len=256, n_continuations=4,\n"
        "                        continuation_len=32)\n"
        "cfg.retrieval.update(n_contexts=1, n_facts=3, context_len=256)\n"
        "cfg.probes.update(n_text=32, length=32)\n"
        "cfg.patch_ffn = False  # W_o patches only: the W_down ridge (1536 features x 30\n"
        "# layers) costs ~2 min of CPU per fit, too slow for 12 fits here; on by default\n"
        "report = experiment.run(cfg)\n"
        "display(Markdown(common.render_markdown(report)))"),
    new_code_cell(
        "fig = plt.figure(figsize=(10, 4))\n"
        "report.plot(fig)\n"
        "common.label_axes(fig, report.columns)  # as results/<run>/plot.png: labels, ticks\n"
        "plt.show()"),
]


def write(path: Path) -> None:
    write_notebook(path, CELLS)


if __name__ == "__main__":
    write_default("patchkv", CELLS)
