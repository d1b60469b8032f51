"""Writes notebooks/tasq.ipynb from the cells below (keeps the notebook reviewable).

    python -m experiments.tasq.make_notebook
"""
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell

from experiments.notebook_cells import INSTALL, write_default, write_notebook


CELLS = [
    new_markdown_cell(
        "# TaSQ: a 1-bit vector-quantised KV cache\n\n"
        "Each 8-channel group of a key or value becomes one byte (256 centroids), so the KV "
        "cache costs 1 bit per channel. TaSQ tailors the quantisation space to the model: "
        "keys are weighted by the queries that read them (folded exactly into W_q/W_k), heads "
        "are normalised (folded), and correlated channels share a code (a permutation inside "
        "the codec). Attention reads the codes directly through per-query lookup tables.\n\n"
        "The full comparison with int8, KIVI, sign-bit, plain VQ and CQ-style baselines is "
        "`python -m experiments.run --config=experiments/tasq/tasq.py:small`. This notebook "
        "walks the API with small shapes (generation works as for any model: "
        "`generate_text(tasq_model, tokenizer, prompts)`)."),
    new_code_cell(INSTALL),
    new_code_cell("import dataclasses, tempfile, time\n"
                  "import jax, jax.numpy as jnp, numpy as np\n"
                  "from research.model import load, forward\n"
                  "from research import data\n"
                  "model, tokenizer = load()\n"
                  "c = model.config\n"
                  "print(c.n_layers, 'layers,', c.n_kv_heads, 'KV heads of dim', c.head_dim)"),
    new_markdown_cell("## Calibrate on calibration text (never the held-out split)"),
    new_code_cell(
        "from research.tasq import TaSQConfig, tasq\n"
        "from research.transforms import CalibrationData, calibrate_and_apply\n"
        "cal = CalibrationData.from_ids(tokenizer.encode(data.corpus_text('calibration')), 128, 4)\n"
        "cfg = TaSQConfig(bits=1, kmeans_iters=4, max_points=1024)  # tiny, for a quick demo\n"
        "t0 = time.time()\n"
        "tasq_model, state = calibrate_and_apply(tasq(cfg), model, cal)\n"
        "print(f'calibrated in {time.time() - t0:.0f}s;', tasq_model.caches[0].describe())\n"
        "print('key codebook', state.key_codebook.shape, 'key perm', state.key_perm.shape)"),
    new_markdown_cell("## The folds are exact\n\nBefore quantisation, the folded model "
                      "(scaled W_q, W_k, W_v, W_o) computes the same logits as the original."),
    new_code_cell(
        "from research.tasq import fold_kv_scales\n"
        "folded = fold_kv_scales(model, state.key_scale, state.value_scale)\n"
        "toks = jnp.asarray([tokenizer.encode('The quick brown fox jumps over the lazy dog.')])\n"
        "a, b = forward(model, toks).logits, forward(folded, toks).logits\n"
        "print('max |logit difference|:', float(jnp.abs(a - b).max()))"),
    new_markdown_cell("## Memory: bytes of the real cache arrays"),
    new_code_cell(
        "from research.kv import memory\n"
        "from research.tasq import bits_per_channel, cache_param_bytes, "
        "max_batch_with_codebooks\n"
        "from research.model.precision import kv_cache_dtype\n"
        "bf16_model, _ = calibrate_and_apply(kv_cache_dtype('bfloat16'), model, None)\n"
        "budget, ctx = 16 * memory.GiB, 4096\n"
        "for name, m in [('bf16', bf16_model), ('TaSQ 1-bit', tasq_model)]:\n"
        "    print(f'{name:10s} {bits_per_channel(m, ctx):5.2f} bits/ch, '\n"
        "          f'{memory.kv_bytes_per_token(m, ctx):7.0f} B/token, codebooks '\n"
        "          f'{cache_param_bytes(m) / 2**10:.0f} KiB, max batch @16GiB/4k: '\n"
        "          f'{max_batch_with_codebooks(m, budget, ctx)}')"),
    new_markdown_cell("## Quality on held-out text (2 short windows; the experiment compares "
                      "every codec on more text)\n\nA 135M model loses a lot at 1 bit per "
                      "channel; see the experiment's table for 2 bits and the baselines."),
    new_code_cell(
        "from research.eval.perplexity import perplexity\n"
        "from research.tasq import attention_output_error\n"
        "held = tokenizer.encode(data.corpus_text('heldout'))\n"
        "for name, m in [('f32', model), ('TaSQ 1-bit', tasq_model)]:\n"
        "    p = perplexity(m, held, window=128, stride=64, max_windows=2, batch_size=2)\n"
        "    print(f'{name:11s} held-out ppl {p.ppl:7.2f}')\n"
        "err = attention_output_error(tasq_model, np.asarray(held[:128]).reshape(1, 128))\n"
        "print('TaSQ attention-output error per layer (first 6):', "
        "np.round(err['per_layer'][:6], 3))"),
    new_markdown_cell("## Decode attention reads codes: lookup tables, no dense K/V\n\n"
                      "One decode query over 16k cached tokens, bf16 dense vs 1-bit codes "
                      "(CPU XLA, medians after warm-up)."),
    new_code_cell(
        "from experiments.tasq.experiment import time_decode\n"
        "t = time_decode({'1bit': tasq_model.caches[0].codec}, c, 16384, batch=1, warmup=1, "
        "repeats=5, seed=0)\n"
        "print(f\"bf16 {t['bf16_ms']:.2f} ms ({t['bf16_bytes']/2**20:.1f} MiB) vs 1-bit "
        "{t['1bit_ms']:.2f} ms ({t['1bit_bytes']/2**20:.2f} MiB): {t['1bit_speedup']:.1f}x\")"),
    new_markdown_cell("## The Pallas kernel (interpret mode on CPU) matches the reference"),
    new_code_cell(
        "from kernels_pallas.vq_attention import BlockSizes, vq_decode_attention\n"
        "rng = np.random.default_rng(0)\n"
        "cache0 = tasq_model.caches[0].codec  # the layer's VQ codec\n"
        "codes = lambda: jnp.asarray(rng.integers(0, 256, (2, 300, 3, 8)), jnp.uint8)\n"
        "args = (jnp.asarray(rng.normal(size=(2, 9, 64)), jnp.float32), codes(), codes(),\n"
        "        cache0.key_codebook, cache0.value_codebook, jnp.array([300, 123]))\n"
        "ref = vq_decode_attention(*args, implementation='xla')\n"
        "ker = vq_decode_attention(*args, implementation='pallas', interpret=True,\n"
        "                          block_sizes=BlockSizes(block_kv=64, blocks_per_split=2))\n"
        "print('max |pallas - reference|:', float(jnp.abs(ker - ref).max()))"),
    new_markdown_cell("## Save and restore the calibration (orbax), bound to its model"),
    new_code_cell(
        "from research.tasq import save_state, restore_state\n"
        "from research.model import init_params, make_model\n"
        "path = save_state(tempfile.mkdtemp() + '/tasq_smollm2', state)\n"
        "restored = restore_state(path, model)\n"
        "print('restored codebooks equal:', bool(jnp.array_equal(restored.key_codebook, "
        "state.key_codebook)))\n"
        "try:\n"
        "    restore_state(path, folded)  # another model: its weights differ\n"
        "except ValueError as e:\n"
        "    print('ValueError:', str(e)[:100], '...')"),
]


def write(path: Path) -> None:
    write_notebook(path, CELLS)


if __name__ == "__main__":
    write_default("tasq", CELLS)
