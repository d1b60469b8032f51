"""Writes notebooks/specscale.ipynb from the cells below (keeps the notebook reviewable).

    python experiments/specscale/make_notebook.py
"""
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell

from experiments.notebook_cells import INSTALL, write_default, write_notebook


CELLS = [
    new_markdown_cell(
        "# SpecScale: speculative search control on a prefix-shared paged KV cache\n\n"
        "1. the paged KV cache: block tables, reference-counted blocks, copy-on-write forks;\n"
        "2. a verifiable task suite and a likelihood verifier that costs a model call;\n"
        "3. beam search vs SpecScale (early pruning, dedup, deferred verification) on "
        "SmolLM2-135M-Instruct;\n4. the Pallas paged decode-attention kernel vs its reference.\n\n"
        "The full comparison (accuracy vs compute, throughput, peak KV blocks) is the "
        "experiment `python -m experiments.run "
        "--config=experiments/specscale/specscale.py:small`."),
    new_code_cell(INSTALL),
    new_markdown_cell("## 1. Blocks, forks and copy-on-write (host bookkeeping)"),
    new_code_cell(
        "from research.kv.block_allocator import BlockManager, OutOfBlocksError\n"
        "m = BlockManager(n_blocks=8, block_size=4, max_blocks_per_seq=4)\n"
        "prompt = m.new_sequence(); m.append(prompt, 6)      # 6 tokens: 1 full + 1 partial block\n"
        "a, b = m.fork(prompt), m.fork(prompt)               # share both blocks, nothing copied\n"
        "print('tables', m.blocks(prompt), m.blocks(a), 'in use', m.allocator.n_used)\n"
        "print('a appends -> copies', m.append(a, 1))        # only the shared partial block\n"
        "print('tables', m.blocks(prompt), m.blocks(a), m.blocks(b))\n"
        "for s in (prompt, a, b): m.free(s)\n"
        "print('in use after freeing all:', m.allocator.n_used)\n"
        "try:\n"
        "    m.append(m.new_sequence(), 4 * 9)\n"
        "except ValueError as e:\n"
        "    print('clear error:', e)"),
    new_markdown_cell("## 2. The task suite and the model"),
    new_code_cell(
        "import jax\n"
        "from research.model import load\n"
        "from research.specscale import ArithmeticChains\n"
        "model, tokenizer = load()\n"
        "task = ArithmeticChains()          # 2 steps, single digits\n"
        "problems = task.problems(2, seed=0)\n"
        "print(task.shared_prompt() + task.problem_prompt(problems[0]))\n"
        "print('reference solution:', repr(problems[0].solution()))"),
    new_markdown_cell(
        "## 3. Search on one shared paged pool\n"
        "The generator prompt and the verifier prompt are prefilled once; every problem "
        "and every candidate forks them. `stats` counts model calls, tokens, verifier "
        "judgements and the peak number of KV blocks. Dedup alone makes beam search's "
        "decisions on the same seed (each merged path keeps its own sampling lineage), "
        "so its texts equal beam search's at a fraction of the tokens."),
    new_code_cell(
        "from research.specscale import PagedEngine, SearchContext, run_search, single_sample, "
        "beam_search, specscale\n"
        "engine = PagedEngine(model, n_blocks=512, block_size=16, max_len=512, temperature=0.5)\n"
        "ctx = SearchContext(engine, tokenizer, task)\n"
        "print('shared prompts hold', engine.blocks_in_use, 'blocks of', engine.block_bytes, "
        "'bytes')\n"
        "limits = dict(max_lines=4, max_line_tokens=16)\n"
        "dedup_only = specscale(2, 4, reject_below=None, prune_margin=None, "
        "prune_token_logp=None, name='dedup only', **limits)\n"
        "texts = {}\n"
        "for cfg in [single_sample(**limits), beam_search(2, 4, **limits), dedup_only, "
        "specscale(2, 4, **limits)]:\n"
        "    r = run_search(ctx, problems, cfg, group_size=2)\n"
        "    texts[cfg.label] = [p.text for p in r.problems]\n"
        "    keys = ('generated_tokens', 'tokens_computed', 'verifier_judgements', "
        "'peak_kv_blocks')\n"
        "    print(f'{cfg.label:16s} acc={r.accuracy:.2f}', {k: r.stats[k] for k in keys})\n"
        "    print('   ', texts[cfg.label])\n"
        "print('dedup only == beam search:', texts['dedup only'] == texts['beam 2x4'])"),
    new_markdown_cell("## 4. The Pallas paged decode-attention kernel (interpret mode on CPU)"),
    new_code_cell(
        "import jax.numpy as jnp, numpy as np\n"
        "from kernels_pallas.paged_attention import paged_decode_attention\n"
        "rng = np.random.default_rng(0)\n"
        "q = jnp.asarray(rng.normal(size=(2, 9, 64)), jnp.float32)\n"
        "k_pool, v_pool = (jnp.asarray(rng.normal(size=(3, 16, 16, 64)), jnp.float32) "
        "for _ in range(2))\n"
        "table = jnp.asarray([[3, 7, 1, -1], [0, 2, 5, 9]], jnp.int32)\n"
        "lengths = jnp.asarray([40, 61], jnp.int32)\n"
        "ref = paged_decode_attention(q, k_pool, v_pool, table, lengths)\n"
        "for backend in ('tpu', 'triton'):\n"
        "    out = paged_decode_attention(q, k_pool, v_pool, table, lengths, "
        "implementation='pallas', backend=backend, interpret=True)\n"
        "    print(backend, 'max |kernel - reference| =', float(jnp.abs(out - ref).max()))"),
]


def write(path: Path) -> None:
    write_notebook(path, CELLS)


if __name__ == "__main__":
    write_default("specscale", CELLS)
