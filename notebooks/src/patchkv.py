# %% [markdown]
# # PatchKV: a ridge weight patch that recovers what KV eviction lost
#
# One context, many queries: the context is prefilled once into a *compressed* KV cache (here SnapKV
# keeps 10% of it). PatchKV then fits, once per context and in closed form, a patch `Delta` of every
# layer's output projection so that attention over the compressed cache, times `W_o + Delta`,
# matches attention over the full cache on probe queries, then a patch of every FFN's `W_down` for
# what is left of the layer's output mismatch. The patched model has the same shapes and FLOPs per
# query. The full comparison (presses x budgets x baselines) is `python -m experiments.run
# --config=experiments/patchkv/patchkv.py:small`.

# %%
import numpy as np
from research import data
from research.model import load
model, tokenizer = load()
ids = tokenizer.encode(data.corpus_text('dev'))  # never calibrated on
calib_ids = np.array(tokenizer.encode(data.corpus_text('calibration')))
context, continuations = np.array(ids[:256]), np.array(ids[256:320]).reshape(2, 32)
print(len(ids), 'held-out (dev half) tokens; context', len(context), 'tokens')

# %% [markdown]
# ## Eviction is a cache
# `evict(policy, ratio)` is a Transform that swaps every dense layer's cache for an
# `EvictingKVCache`: the context attends to itself in full during prefill, then only `ceil(ratio *
# n)` tokens per KV head are kept (`streaming_llm`, `h2o`, `snapkv`, `random`, `knorm`). Later
# chunks append.

# %%
from research.kv.base import state_nbytes
from research.eviction import evict, kept_tokens, trim_states
from research.patchkv import prefill_context
compressed = evict('snapkv', 0.1).apply(model, ())
max_len = len(context) + 64
ctx = prefill_context(compressed, context, max_len)
print(compressed.caches[0].describe(), 'kept per layer:',
      int(kept_tokens(ctx.states[0])[0]), 'of', len(context))
print('context KV bytes, trimmed to the kept slots:',
      state_nbytes(trim_states(ctx.states, room=0)))

# %% [markdown]
# ## Fit the patch: `chain(evict(...), patchkv(...))`
# The calibration data is the context itself. Probe rows follow it: here spans of real text from the
# calibration split (`n_text`; sampled continuations of the full-cache model, `n_generated`, and
# re-fed spans of the context, `n_repeat`, are the other kinds). Lambda is chosen per layer on
# held-out probe rows (the zero patch competes, so a layer that does not gain stays unpatched);
# `ffn=True` adds the W_down patch after each layer's W_o patch. `strengths` then scales the whole
# patch by the factor with the least KL(full-cache model || patched model) on the held-out rows, 0
# included: the per-layer fits see activations, this check sees next-token distributions.

# %%
from research.patchkv import (ProbeConfig, attention_error, decode_flops,
                              param_shapes, patch_nbytes, patchkv, reference_model,
                              score_continuations, summarize)
from research.transforms import CalibrationData, calibrate_and_apply, chain
t = chain(evict('snapkv', 0.1), patchkv(
    probes=ProbeConfig(n_generated=0, n_text=8, length=32), probe_text=calib_ids,
    ffn=True, strengths=(0.5, 1.0, 1.5)))
calib = CalibrationData.from_context(context)
patched, (_, pstate) = calibrate_and_apply(t, model, calib)
print(t.name)
print({k: round(v, 3) if isinstance(v, float) else v
       for k, v in summarize(pstate).items()})

# %% [markdown]
# On a quantised cache the same transform chains after the quantizer: `chain(frozen_tasq,
# patchkv(...))`. Optionally `query_scales=DEV_QUERY_SCALES` first lets one W_q scale per query head
# (a logit temperature, folded into the weight) compete on the same held-out KL: a 1-bit key
# codebook flattens attention, which no map of the attention output can sharpen back (the experiment
# leaves it off: the text rows and the W_down patch did better on its dev split).

# %% [markdown]
# ## Many queries over one compressed context
# The compressed cache was built by the unpatched model; every query is served by the patched one
# over that cache.

# %%
ref = reference_model(model)
full = score_continuations(ref, prefill_context(ref, context, max_len),
                           continuations, attention=True)
for name, m in [('no patch', compressed), ('PatchKV', patched)]:
    s = score_continuations(m, ctx, continuations, attention=True)
    print(f'{name:9s} ppl {np.exp(s.nll):7.2f}  attention error '
          f'{attention_error(s.attn_contrib, full.attn_contrib):.3f}')
print(f'full cache ppl {np.exp(full.nll):7.2f}')

# %% [markdown]
# ## Zero per-query overhead: same parameter shapes, same decode FLOPs

# %%
print('same shapes:', param_shapes(patched) == param_shapes(compressed))
# XLA cost analysis of the compiled decode step over this context's cache
flops = [decode_flops(m, ctx.states, [len(context)])
         for m in (compressed, patched)]
print('decode-step FLOPs (unpatched, patched):', flops)
print('patch memory (MB, dense f32):', patch_nbytes(pstate) / 2**20)

# %% [markdown]
# ## The experiment's table and plot, at notebook scale
# `experiments.patchkv.experiment.run` is what `python -m experiments.run` calls. Here it runs on a
# reduced config: one 256-token continuation context (4 continuations of 32 tokens) and one
# retrieval context with 3 facts, SnapKV and StreamingLLM at 10 / 25 / 50%, no patch vs PatchKV vs
# the GRKV-style ridge merge vs the Attention-Matching-style value fit, 32 text probe rows (the
# retrieval context: 64 context repeats, `cfg.retrieval.probes`), W_o patches only. One small
# context is noisy, and retrieval gains need the W_down patch: the README reports the `small` run
# (two 512-token contexts, W_o + W_down).

# %%
import matplotlib.pyplot as plt
from IPython.display import Markdown, display
from experiments import common
from experiments.patchkv import experiment
from experiments.patchkv.patchkv import get_config
cfg = get_config('small')
cfg.budgets, cfg.methods = (0.1, 0.25, 0.5), ((), ('patchkv',), ('grkv',), ('am',))
cfg.quantizers, cfg.ablations, cfg.check_flops = (), (), False  # FLOPs: above
cfg.continuation.update(n_contexts=1, context_len=256, n_continuations=4,
                        continuation_len=32)
cfg.retrieval.update(n_contexts=1, n_facts=3, context_len=256)
cfg.probes.update(n_text=32, length=32)
cfg.patch_ffn = False  # W_o patches only: the W_down ridge (1536 features x 30
# layers) costs ~2 min of CPU per fit, too slow for 12 fits here; on by default
report = experiment.run(cfg)
display(Markdown(common.render_markdown(report)))

# %%
fig = plt.figure(figsize=(10, 4))
report.plot(fig)
common.label_axes(fig, report.columns)  # as results/<run>/plot.png: labels, ticks
plt.show()
