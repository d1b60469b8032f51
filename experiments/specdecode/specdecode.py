r"""Speculative decoding on SmolLM2-135M-Instruct: acceptance, tokens/forward, wall speedup.

Command:   python -m experiments.run --config=experiments/specdecode/specdecode.py:small
Hardware:  small = CPU, about 10 minutes on 2 idle cores (2-3x that when the cores are
           shared); full = 5 + 6 prompts, 256 tokens, 5 repeats, a batched run (CPU ~1 h).
Expected:  greedy output identical to plain greedy decoding for every prompt and drafter;
           the sampled joint law of the first tokens matches the exact target law
           (chi-square, small-vocabulary model and SmolLM2); prompt lookup >= 1.5x wall
           speedup on repetitive prompts (edit / repeat a text in the context) and
           >= 0.95x on free-form chat thanks to the adaptive draft length; the
           self-speculative (early-exit) drafter of this 135M model agrees too rarely to
           pay for itself, and the adaptive policy falls back to plain decoding.
"""
import ml_collections


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    if arg not in ("small", "full"):
        raise ValueError(f"config arg must be 'small' or 'full', got {arg!r}")
    small = arg == "small"
    c = ml_collections.ConfigDict()
    c.experiment = "experiments.specdecode.experiment"
    c.run_name = f"specdecode_{arg}"
    c.seed = 0
    c.gguf_path = ""  # empty: the embedded SmolLM2-135M-Instruct
    c.max_new_tokens = 64 if small else 256
    c.n_repetitive = 2 if small else 4  # prompts from experiments/specdecode/prompts.py
    c.n_free_form = 2 if small else 6
    # a third repetitive / free-form pair only in `full`: see prompts.py
    c.repeats = 5 if small else 7  # timed rounds per prompt, variants interleaved
    c.draft_lengths = (0, 1, 2, 4, 8)
    c.fixed_draft = 8  # the non-adaptive baseline drafts this many whenever it can
    c.max_ngram = 3
    c.cost_repeats = 5 if small else 9
    c.early_exit_layers = 20  # self-speculative drafter: first L of 30 layers
    c.early_exit_draft_lengths = (0, 2) if small else (0, 1, 2, 4)
    c.early_exit_prompts = 1 if small else 2  # first prompts of each category
    c.batch_rows = 0 if small else 4  # batched run mixing both categories (0: skip)
    c.stat_test = ml_collections.ConfigDict(dict(
        tiny_samples=20_000 if small else 100_000,  # small-vocabulary exact check
        smollm2_samples=256 if small else 1024,  # SmolLM2 (t1, t2) check
        temperature=1.0, top_k=8))
    return c
