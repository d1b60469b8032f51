# %% [markdown]
# # DynaCore: one weight set per serving phase
#
# Prefill is compute-bound: W8A8 (int8 weights per output channel, int8 activations per token, int8
# x int8 -> int32). Decode is memory-bound: W4A16 (packed int4 weights, group-wise scales and zero
# points, float activations). One model holds both sets; prefill writes the KV cache with one,
# decode continues with the other.
#
# 1. quantize SmolLM2-135M-Instruct and count the real bytes;
# 2. DynaCore in `generate`;
# 3. the handoff protocol's quality (KL vs f32 on decoded tokens);
# 4. the Pallas kernels (interpret mode) against their references;
# 5. the MODELED roofline and the KV-size calculator;
# 6. the committed experiment tables.
#
# The full run: `python -m experiments.run --config=experiments/dynacore/dynacore.py:small`.

# %% [markdown]
# ## 1. Quantize every linear layer (qwix computes the codes)
# Round to nearest needs no data. GPTQ (`method='gptq'`) and SmoothQuant (`w8a8(smooth=...)`) read
# the layers' inputs on calibration text, so their transforms take a `CalibrationData`.
# `zero_point='float'` is llama.cpp Q4_1's grid: the embedded GGUF is stored in Q4_1, so at g32 it
# holds the f32 weights exactly.

# %%
import jax.numpy as jnp, numpy as np
from research.model import load
from research.dynacore import quantize, dynacore, w8a8, w4a16, weight_bytes
from research.transforms import calibrate_and_apply
model, tokenizer = load()
print('f32', {k: f'{v / 1e6:.1f} MB' for k, v in weight_bytes(model).items()})
models = {}
for cfg in (w8a8(), w4a16(64)):
    models[cfg.name], state = calibrate_and_apply(quantize(cfg), model, None)
    print(cfg.name, {k: f'{v / 1e6:.1f} MB' for k, v in weight_bytes(models[cfg.name]).items()})
from research.transforms import CalibrationData
cal = CalibrationData.from_corpus(tokenizer, 256, 4)
for cfg in (w8a8(smooth=0.5), w4a16(64, zero_point='float', method='gptq')):
    models[cfg.name], state = calibrate_and_apply(quantize(cfg), model, cal)
    print(cfg.name, 'calibrated on', cal.tokens.size, 'tokens')
for bad in (lambda: quantize(w4a16(128)).calibrate(model, None),
            lambda: quantize(w4a16(64, method='gptq')).calibrate(model, None)):
    try:
        bad()
    except ValueError as e:
        print('clear error:', e)

# %% [markdown]
# ## 2. DynaCore in generate: W8A8 prefill, W4A16 decode
# `model.prefill_model` / `model.decode_model` are the two views; `generate` uses them, a plain
# forward on the undivided model is an error.

# %%
from research.decode.generate import generate_text
# the settings the experiment chose on its dev windows (results/dynacore_small)
dc, dc_state = calibrate_and_apply(
    dynacore(prefill=w8a8(smooth=0.5), decode=w4a16(64, zero_point='float', method='gptq')),
    model, cal)
print('both sets:', f"{weight_bytes(dc)['linear'] / 1e6:.1f} MB of linear weights")
q = ['What is the capital of France?']
print('f32     :', generate_text(model, tokenizer, q, max_new_tokens=16))
print('DynaCore:', generate_text(dc, tokenizer, q, max_new_tokens=16))

# %% [markdown]
# ## 3. Handoff quality: prefill with one setting, decode with another
# Two held-out (dev half) windows of 128 tokens, 64 prefilled; KL(f32 || setting) per decoded
# token (the experiment uses more windows and reports perplexity too).

# %%
from research import data
from research.dynacore import evaluate_pairs, windows
ids = tokenizer.encode(data.corpus_text('dev'))
test = windows(ids, 128, 2)
pairs = {name: (m,) * 2 for name, m in models.items()}
pairs['DynaCore'] = (dc.prefill_model, dc.decode_model)
for name, s in evaluate_pairs(pairs, (model, model), test, 64, 2).items():
    print(f'{name:10s} ppl decoded {s.ppl_decode:.3f}  KL decoded {s.kl_decode:.4f}')

# %% [markdown]
# ## 4. The Pallas kernels (interpret mode on CPU) vs their references

# %%
from kernels_pallas.quant_matmul import (int8_matmul, int8_matmul_reference, int4_matmul,
                                         int4_matmul_reference, pack_int4, BlockSizes)
rng = np.random.default_rng(0)
xq = jnp.asarray(rng.integers(-127, 128, (8, 256)), jnp.int8)
wq = jnp.asarray(rng.integers(-127, 128, (256, 64)), jnp.int8)
xs, ws = jnp.full((8, 1), 0.01), jnp.full((1, 64), 0.02)
x = jnp.asarray(rng.normal(size=(8, 256)), jnp.float32)
p = pack_int4(jnp.asarray(rng.integers(0, 16, (256, 64)), jnp.uint8), 64)
s = jnp.asarray(rng.uniform(0.01, 0.1, (4, 64)), jnp.float32)
z = jnp.asarray(rng.integers(0, 16, (4, 64)), jnp.uint8)
for backend in ('mosaic_tpu', 'triton'):
    a = int8_matmul(xq, xs, wq, ws, implementation='pallas', backend=backend, interpret=True,
                    block_sizes=BlockSizes(8, 64, 32))
    b = int4_matmul(x, p, s, z, group_size=64, implementation='pallas', backend=backend,
                    interpret=True, block_sizes=BlockSizes(8, 64, 32))
    print(backend, float(jnp.abs(a - int8_matmul_reference(xq, xs, wq, ws)).max()),
          float(jnp.abs(b - int4_matmul_reference(x, p, s, z, 64)).max()))

# %% [markdown]
# ## 5. MODELED roofline (datasheet rates) and the KV calculator
# Llama-3.1-70B on 8 GPUs as one ideal tensor-parallel device (mfu 0.6, mbu 0.8).

# %%
from research.dynacore import (BF16, GPUS, LINKS, LLAMA_31_70B, W4A16_G64, W8A8,
                               kv_bytes, tpot_s, transfer_s, ttft_s)
c = LLAMA_31_70B
for name, gpu in GPUS.items():
    t = [ttft_s(c, 8192, s, gpu) for s in (BF16, W8A8)]
    d = [tpot_s(c, 1, 4096, s, gpu) for s in (BF16, W4A16_G64)]
    print(f'{name}: TTFT(8k) bf16/W8A8 = {t[0] / t[1]:.2f}x, TPOT(b1) bf16/W4A16 = '
          f'{d[0] / d[1]:.2f}x  (modeled; the seed claims 3.50x and 36.55x)')
kv = kv_bytes(c, 32768)
print(f'KV at 32k: {kv / 1e9:.2f} GB bf16, '
      f'{kv_bytes(c, 32768, bits=1) / 1e9:.2f} GB as 1-bit codes')
for link, bps in LINKS.items():
    print(f'  {link}: {1e3 * transfer_s(kv, bps):.1f} ms')

# %% [markdown]
# ## 6. The committed experiment tables

# %%
from pathlib import Path
from IPython.display import Markdown, display
table = Path('..') / 'results' / 'dynacore_small' / 'table.md'
display(Markdown(table.read_text()) if table.exists() else 'run the experiment first')
