# %% [markdown]
# # TaSQ: a 1-bit vector-quantised KV cache
#
# Each 8-channel group of a key or value becomes one byte (256 centroids), so the KV cache costs 1
# bit per channel. TaSQ tailors the quantisation space to the model: keys are weighted by the
# queries that read them (folded exactly into W_q/W_k), heads are normalised (folded), and
# correlated channels share a code (a permutation inside the codec). Attention reads the codes
# directly through per-query lookup tables.
#
# The full comparison with int8, KIVI, sign-bit, plain VQ and CQ-style baselines is `python -m
# experiments.run --config=experiments/tasq/tasq.py:small`. This notebook walks the API with small
# shapes (generation works as for any model: `generate_text(tasq_model, tokenizer, prompts)`).

# %%
import tempfile, time
import jax.numpy as jnp, numpy as np
from research.model import load, forward
from research import data
model, tokenizer = load()
c = model.config
print(c.n_layers, 'layers,', c.n_kv_heads, 'KV heads of dim', c.head_dim)

# %% [markdown]
# ## Calibrate on calibration text (never the held-out split)

# %%
from research.tasq import TaSQConfig, tasq
from research.transforms import CalibrationData, calibrate_and_apply
cal = CalibrationData.from_corpus(tokenizer, 128, 4)
cfg = TaSQConfig(bits=1, kmeans_iters=4, max_points=1024)  # tiny, for a quick demo
t0 = time.time()
tasq_model, state = calibrate_and_apply(tasq(cfg), model, cal)
print(f'calibrated in {time.time() - t0:.0f}s;', tasq_model.caches[0].describe())
print('key codebook', state.key_codebook.shape, 'key perm', state.key_perm.shape)

# %% [markdown]
# ## The folds are exact
#
# Before quantisation, the folded model (scaled W_q, W_k, W_v, W_o) computes the same logits as the
# original.

# %%
from research.tasq import fold_kv_scales
folded = fold_kv_scales(model, state.key_scale, state.value_scale)
toks = jnp.asarray([tokenizer.encode('The quick brown fox jumps over the lazy dog.')])
a, b = forward(model, toks).logits, forward(folded, toks).logits
print('max |logit difference|:', float(jnp.abs(a - b).max()))

# %% [markdown]
# ## Memory: bytes of the real cache arrays

# %%
from research.kv import memory
from research.tasq import bits_per_channel, cache_param_bytes, max_batch_with_codebooks
from research.model.precision import kv_cache_dtype
bf16_model, _ = calibrate_and_apply(kv_cache_dtype('bfloat16'), model, None)
budget, ctx = 16 * memory.GiB, 4096
for name, m in [('bf16', bf16_model), ('TaSQ 1-bit', tasq_model)]:
    print(f'{name:10s} {bits_per_channel(m, ctx):5.2f} bits/ch, '
          f'{memory.kv_bytes_per_token(m, ctx):7.0f} B/token, codebooks '
          f'{cache_param_bytes(m) / 2**10:.0f} KiB, max batch @16GiB/4k: '
          f'{max_batch_with_codebooks(m, budget, ctx)}')

# %% [markdown]
# ## Quality on held-out text (2 short windows of the dev half; the experiment compares every
# codec on more text)
#
# A 135M model loses a lot at 1 bit per channel; see the experiment's table for 2 bits and the
# baselines.

# %%
from research.eval.perplexity import perplexity
from research.tasq import attention_output_error
held = tokenizer.encode(data.corpus_text('dev'))
for name, m in [('f32', model), ('TaSQ 1-bit', tasq_model)]:
    p = perplexity(m, held, window=128, stride=64, max_windows=2, batch_size=2)
    print(f'{name:11s} held-out ppl {p.ppl:7.2f}')
err = attention_output_error(tasq_model, np.asarray(held[:128]).reshape(1, 128))
print('TaSQ attention-output error per layer (first 6):', np.round(err['per_layer'][:6], 3))

# %% [markdown]
# ## Decode attention reads codes: lookup tables, no dense K/V
#
# One decode query over 16k cached tokens, bf16 dense vs 1-bit codes (CPU XLA, medians after
# warm-up).

# %%
from experiments.tasq.experiment import time_decode
t = time_decode({'1bit': tasq_model.caches[0].codec}, c, 16384, batch=1, warmup=1, repeats=5,
                seed=0)
print(f"bf16 {t['bf16_ms']:.2f} ms ({t['bf16_bytes']/2**20:.1f} MiB) vs 1-bit "
      f"{t['1bit_ms']:.2f} ms ({t['1bit_bytes']/2**20:.2f} MiB): {t['1bit_speedup']:.1f}x")

# %% [markdown]
# ## The Pallas kernel (interpret mode on CPU) matches the reference

# %%
from kernels_pallas.vq_attention import BlockSizes, vq_decode_attention
rng = np.random.default_rng(0)
cache0 = tasq_model.caches[0].codec  # the layer's VQ codec
codes = lambda: jnp.asarray(rng.integers(0, 256, (2, 300, 3, 8)), jnp.uint8)
args = (jnp.asarray(rng.normal(size=(2, 9, 64)), jnp.float32), codes(), codes(),
        cache0.key_codebook, cache0.value_codebook, jnp.array([300, 123]))
ref = vq_decode_attention(*args, implementation='xla')
ker = vq_decode_attention(*args, implementation='pallas', interpret=True,
                          block_sizes=BlockSizes(block_kv=64, blocks_per_split=2))
print('max |pallas - reference|:', float(jnp.abs(ker - ref).max()))

# %% [markdown]
# ## Save and restore the calibration (orbax), bound to its model

# %%
from research.tasq import save_state, restore_state
path = save_state(tempfile.mkdtemp() + '/tasq_smollm2', state)
restored = restore_state(path, model)
print('restored codebooks equal:', bool(jnp.array_equal(restored.key_codebook, state.key_codebook)))
try:
    restore_state(path, folded)  # another model: its weights differ
except ValueError as e:
    print('ValueError:', str(e)[:100], '...')
