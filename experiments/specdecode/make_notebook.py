"""Writes notebooks/specdecode.ipynb from the cells below (keeps the notebook reviewable).

    python -m experiments.specdecode.make_notebook
"""
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell

from experiments.notebook_cells import INSTALL, write_default, write_notebook


CELLS = [
    new_markdown_cell(
        "# Speculative decoding with the target's exact output distribution\n\n"
        "A cheap *drafter* guesses the next k tokens; the target model checks all of them "
        "in one forward pass over its KV cache and keeps a prefix by exact rejection "
        "sampling (Leviathan et al. 2023), so greedy output is plain greedy output token "
        "for token and sampled output has the target's distribution. Rejected tokens' K/V "
        "are rolled back by not advancing the row's length. The full measurement: "
        "`python -m experiments.run --config=experiments/specdecode/specdecode.py:small`."),
    new_code_cell(INSTALL),
    new_code_cell(
        "import jax\n"
        "from research.model import load\n"
        "from research.serving.generate import generate, default_stop_tokens\n"
        "from research.serving.sampling import SamplingConfig\n"
        "from research.specdecode import (DraftLengthPolicy, prompt_lookup, early_exit,\n"
        "                                 model_drafter, layer_subset_model, "
        "speculative_generate)\n"
        "model, tokenizer = load()\n"
        "stops = default_stop_tokens(tokenizer)"),
    new_markdown_cell(
        "## Prompt lookup on a repetitive prompt (greedy)\n"
        "The drafter copies what followed the latest earlier occurrence of the last 1-3 "
        "tokens; the adaptive policy picks k per step from the running acceptance rate of "
        "each n-gram size."),
    new_code_cell(
        "text = ('The cat sat on the warm windowsill every afternoon, watching the birds in '\n"
        "        'the garden. When the sun moved behind the old oak tree, the cat would '\n"
        "        'stretch and walk slowly to the kitchen.')\n"
        "ids = [tokenizer.encode(tokenizer.apply_chat_template(\n"
        "    [{'role': 'user', 'content': 'Repeat the following text exactly:\\n\\n' + text}]))]\n"
        "plain = generate(model, ids, max_new_tokens=48, stop_tokens=stops)\n"
        "spec = speculative_generate(model, ids, drafter=prompt_lookup(), max_new_tokens=48,\n"
        "                            stop_tokens=stops)\n"
        "print(tokenizer.decode(spec.tokens[0], skip_special=True))\n"
        "print('identical to plain greedy:', spec.tokens == plain.tokens)\n"
        "print(f'acceptance {spec.stats.acceptance_rate:.2f}, '\n"
        "      f'{spec.tokens_per_forward():.2f} tokens per target forward, '\n"
        "      f'draft lengths used: {spec.stats.branch_counts}')"),
    new_markdown_cell(
        "## Wall time in this process (warm, interleaved)\n"
        "On a CPU a verify pass of k + 1 tokens costs more than one token; "
        "`measure_step_costs` measures that curve and the policy uses it."),
    new_code_cell(
        "from research.core.timing import time_interleaved\n"
        "times = time_interleaved({\n"
        "    'plain': lambda: generate(model, ids, max_new_tokens=48, stop_tokens=stops),\n"
        "    'spec': lambda: speculative_generate(model, ids, drafter=prompt_lookup(),\n"
        "                                         max_new_tokens=48, stop_tokens=stops)},\n"
        "    warmup=0, repeats=2)  # both already compiled above\n"
        "t_plain, t_spec = (min(times[k]['wall_s']) for k in ('plain', 'spec'))\n"
        "print(f'plain {t_plain:.2f}s, speculative {t_spec:.2f}s: {t_plain / t_spec:.2f}x')"),
    new_markdown_cell(
        "## Other drafters\n"
        "`early_exit(L)` drafts with the target's first L layers and its shared head and "
        "KV caches (self-speculative); `model_drafter(m)` plugs in any separate model with "
        "the same vocabulary (here, for illustration, a 10-layer slice of SmolLM2 with its "
        "own cache). On this 135M model such drafts agree rarely, and the adaptive policy "
        "falls back to plain decoding steps."),
    new_code_cell(
        "small = layer_subset_model(model, range(10))\n"
        "policy = DraftLengthPolicy(draft_lengths=(0, 2, 4))\n"
        "for drafter in [early_exit(10), model_drafter(small, name='10-layer slice')]:\n"
        "    out = speculative_generate(model, ids, drafter=drafter, max_new_tokens=16,\n"
        "                               stop_tokens=stops, policy=policy)\n"
        "    same = out.tokens == generate(model, ids, max_new_tokens=16, "
        "stop_tokens=stops).tokens\n"
        "    print(drafter.name, 'identical:', same, 'acceptance:',\n"
        "          round(out.stats.acceptance_rate, 2), out.stats.branch_counts)"),
    new_markdown_cell(
        "## Exactness of sampling\n"
        "On a random model with a 6-token vocabulary, the joint law of the first three "
        "sampled tokens is enumerated exactly and compared with 20,000 speculative samples "
        "(chi-square)."),
    new_code_cell(
        "from research.model import init_params, make_model, tiny_config\n"
        "from research.specdecode import chisquare_pvalue, exact_sequence_law\n"
        "cfg = tiny_config(vocab_size=6)\n"
        "params = jax.tree.map(lambda x: 1.5 * x if x.ndim >= 2 else x,\n"
        "                      init_params(cfg, jax.random.key(0)))\n"
        "params['embed'] = params['embed'] * 0.1\n"
        "tiny = make_model(cfg, params)\n"
        "prompt, sampling = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingConfig(temperature=1.0, "
        "top_k=4)\n"
        "out = speculative_generate(tiny, [prompt] * 20_000, drafter=prompt_lookup(),\n"
        "                           max_new_tokens=5, key=jax.random.key(1), "
        "sampling=sampling,\n"
        "                           policy=DraftLengthPolicy(draft_lengths=(0, 2), "
        "adaptive=False))\n"
        "law = exact_sequence_law(tiny, prompt, sampling, 3)\n"
        "print('acceptance', round(out.stats.acceptance_rate, 3), 'chi-square p-value',\n"
        "      round(chisquare_pvalue([t[:3] for t in out.tokens], law), 3))"),
]


def write(path: Path) -> None:
    write_notebook(path, CELLS)


if __name__ == "__main__":
    write_default("specdecode", CELLS)
