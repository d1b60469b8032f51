"""Writes notebooks/dynacore.ipynb from the cells below (keeps the notebook reviewable).

    python experiments/dynacore/make_notebook.py
"""
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell

from experiments.notebook_cells import INSTALL, write_default, write_notebook

CELLS = [
    new_markdown_cell(
        "# DynaCore: one weight set per serving phase\n\n"
        "Prefill is compute-bound: W8A8 (int8 weights per output channel, int8 activations "
        "per token, int8 x int8 -> int32). Decode is memory-bound: W4A16 (packed int4 "
        "weights, group-wise scales and zero points, float activations). One model holds "
        "both sets; prefill writes the KV cache with one, decode continues with the other.\n\n"
        "1. quantize SmolLM2-135M-Instruct and count the real bytes;\n"
        "2. DynaCore in `generate`;\n"
        "3. the handoff protocol's quality (KL vs f32 on decoded tokens);\n"
        "4. the Pallas kernels (interpret mode) against their references;\n"
        "5. the MODELED roofline and the KV-size calculator;\n"
        "6. the committed experiment tables.\n\n"
        "The full run: `python -m experiments.run "
        "--config=experiments/dynacore/dynacore.py:small`."),
    new_code_cell(INSTALL),
    new_markdown_cell(
        "## 1. Quantize every linear layer (qwix computes the codes)\n"
        "Round to nearest needs no data. GPTQ (`method='gptq'`) and SmoothQuant "
        "(`w8a8(smooth=...)`) read the layers' inputs on calibration text, so their "
        "transforms take a `CalibrationData`. `zero_point='float'` is llama.cpp Q4_1's "
        "grid: the embedded GGUF is stored in Q4_1, so at g32 it holds the f32 weights "
        "exactly."),
    new_code_cell(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "from research.model import load\n"
        "from research.dynacore import quantize, dynacore, w8a8, w8a16, w4a16, weight_bytes\n"
        "from research.transforms import calibrate_and_apply\n"
        "model, tokenizer = load()\n"
        "print('f32', {k: f'{v / 1e6:.1f} MB' for k, v in weight_bytes(model).items()})\n"
        "models = {}\n"
        "for cfg in (w8a8(), w4a16(64)):\n"
        "    models[cfg.name], state = calibrate_and_apply(quantize(cfg), model, None)\n"
        "    print(cfg.name, {k: f'{v / 1e6:.1f} MB' for k, v in "
        "weight_bytes(models[cfg.name]).items()})\n"
        "from research import data\n"
        "from research.transforms import CalibrationData\n"
        "cal = CalibrationData.from_ids(tokenizer.encode(data.corpus_text('calibration')), "
        "256, 4)\n"
        "for cfg in (w8a8(smooth=0.5), w4a16(64, zero_point='float', method='gptq')):\n"
        "    models[cfg.name], state = calibrate_and_apply(quantize(cfg), model, cal)\n"
        "    print(cfg.name, 'calibrated on', cal.tokens.size, 'tokens')\n"
        "for bad in (lambda: quantize(w4a16(128)).calibrate(model, None),\n"
        "            lambda: quantize(w4a16(64, method='gptq')).calibrate(model, None)):\n"
        "    try:\n"
        "        bad()\n"
        "    except ValueError as e:\n"
        "        print('clear error:', e)"),
    new_markdown_cell(
        "## 2. DynaCore in generate: W8A8 prefill, W4A16 decode\n"
        "`model.prefill_model` / `model.decode_model` are the two views; `generate` uses "
        "them, a plain forward on the undivided model is an error."),
    new_code_cell(
        "from research.serving.generate import generate_text\n"
        "# the settings the experiment chose on its dev windows (results/dynacore_small)\n"
        "dc, dc_state = calibrate_and_apply(\n"
        "    dynacore(prefill=w8a8(smooth=0.5), decode=w4a16(64, zero_point='float', "
        "method='gptq')),\n"
        "    model, cal)\n"
        "print('both sets:', f\"{weight_bytes(dc)['linear'] / 1e6:.1f} MB of linear weights\")\n"
        "q = ['What is the capital of France?']\n"
        "print('f32     :', generate_text(model, tokenizer, q, max_new_tokens=16))\n"
        "print('DynaCore:', generate_text(dc, tokenizer, q, max_new_tokens=16))"),
    new_markdown_cell(
        "## 3. Handoff quality: prefill with one setting, decode with another\n"
        "Two held-out windows of 128 tokens, 64 prefilled; KL(f32 || setting) per decoded "
        "token (the experiment uses more windows and reports perplexity too)."),
    new_code_cell(
        "from research import data\n"
        "from research.dynacore import evaluate_pairs, windows\n"
        "ids = tokenizer.encode(data.corpus_text('heldout'))\n"
        "test = windows(ids, 128, 2)\n"
        "pairs = {name: (m,) * 2 for name, m in models.items()}\n"
        "pairs['DynaCore'] = (dc.prefill_model, dc.decode_model)\n"
        "for name, s in evaluate_pairs(pairs, (model, model), test, 64, 2).items():\n"
        "    print(f'{name:10s} ppl decoded {s.ppl_decode:.3f}  KL decoded {s.kl_decode:.4f}')"),
    new_markdown_cell("## 4. The Pallas kernels (interpret mode on CPU) vs their references"),
    new_code_cell(
        "from kernels_pallas.quant_matmul import (int8_matmul, int8_matmul_reference, "
        "int4_matmul, int4_matmul_reference, pack_int4, BlockSizes)\n"
        "rng = np.random.default_rng(0)\n"
        "xq = jnp.asarray(rng.integers(-127, 128, (8, 256)), jnp.int8)\n"
        "wq = jnp.asarray(rng.integers(-127, 128, (256, 64)), jnp.int8)\n"
        "xs, ws = jnp.full((8, 1), 0.01), jnp.full((1, 64), 0.02)\n"
        "x = jnp.asarray(rng.normal(size=(8, 256)), jnp.float32)\n"
        "p = pack_int4(jnp.asarray(rng.integers(0, 16, (256, 64)), jnp.uint8), 64)\n"
        "s = jnp.asarray(rng.uniform(0.01, 0.1, (4, 64)), jnp.float32)\n"
        "z = jnp.asarray(rng.integers(0, 16, (4, 64)), jnp.uint8)\n"
        "for backend in ('mosaic_tpu', 'triton'):\n"
        "    a = int8_matmul(xq, xs, wq, ws, implementation='pallas', backend=backend, "
        "interpret=True, block_sizes=BlockSizes(8, 64, 32))\n"
        "    b = int4_matmul(x, p, s, z, group_size=64, implementation='pallas', "
        "backend=backend, interpret=True, block_sizes=BlockSizes(8, 64, 32))\n"
        "    print(backend, float(jnp.abs(a - int8_matmul_reference(xq, xs, wq, ws)).max()),\n"
        "          float(jnp.abs(b - int4_matmul_reference(x, p, s, z, 64)).max()))"),
    new_markdown_cell(
        "## 5. MODELED roofline (datasheet rates) and the KV calculator\n"
        "Llama-3.1-70B on 8 GPUs as one ideal tensor-parallel device (mfu 0.6, mbu 0.8)."),
    new_code_cell(
        "from research.dynacore import (BF16, GPUS, LINKS, LLAMA_31_70B, W4A16_G64, W8A8,\n                               kv_bytes, tpot_s, transfer_s, ttft_s)\n"
        "c = LLAMA_31_70B\n"
        "for name, gpu in GPUS.items():\n"
        "    t = [ttft_s(c, 8192, s, gpu) for s in (BF16, W8A8)]\n"
        "    d = [tpot_s(c, 1, 4096, s, gpu) for s in (BF16, "
        "W4A16_G64)]\n"
        "    print(f'{name}: TTFT(8k) bf16/W8A8 = {t[0] / t[1]:.2f}x, TPOT(b1) bf16/W4A16 = '\n"
        "          f'{d[0] / d[1]:.2f}x  (modeled; the seed claims 3.50x and 36.55x)')\n"
        "kv = kv_bytes(c, 32768)\n"
        "print(f'KV at 32k: {kv / 1e9:.2f} GB bf16, '\n"
        "      f'{kv_bytes(c, 32768, bits=1) / 1e9:.2f} GB as 1-bit codes')\n"
        "for link, bps in LINKS.items():\n"
        "    print(f'  {link}: {1e3 * transfer_s(kv, bps):.1f} ms')"),
    new_markdown_cell("## 6. The committed experiment tables"),
    new_code_cell(
        "from pathlib import Path\n"
        "from IPython.display import Markdown, display\n"
        "table = Path('..') / 'results' / 'dynacore_small' / 'table.md'\n"
        "display(Markdown(table.read_text()) if table.exists() else "
        "'run the experiment first')"),
]


def write(path: Path) -> None:
    write_notebook(path, CELLS)


if __name__ == "__main__":
    write_default("dynacore", CELLS)
