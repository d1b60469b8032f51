r"""Baseline: SmolLM2-135M-Instruct perplexity, throughput and KV memory, f32 vs bf16.

Command:   python -m experiments.run --config=experiments/baseline/baseline.py:small
Hardware:  small = CPU, 744 s on 2 cores (results/baseline_small/, at 743686e); full =
           CPU/GPU, whole held-out split.
Expected:  held-out perplexity 16.69 (f32) and 16.70 (bf16, +0.09%) on the small run's 2,175
           scored tokens (results/baseline_small/; target: bf16 within 1%); KV cache
           of 30 layers x 3 KV heads x 64 dims x 2 x 4 B = 46,080 B/token in f32
           (23,040 in bf16); a sample greedy answer that names Paris.
"""
import ml_collections

from experiments import common


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.baseline.experiment")
    c.text_path = ""  # empty: the test half of the held-out prose (research/data.py)
    c.text_split = "test"
    # test text: "pydoc" (the held-out test half) or "stdlib" (the fresh test text,
    # research/data.py; test runs only)
    c.test_text = "pydoc"
    small = arg == "small"
    c.ppl = ml_collections.ConfigDict(dict(
        window=256 if small else 1024, stride=128 if small else 512,
        batch_size=4, max_windows=16 if small else 0))
    c.throughput = ml_collections.ConfigDict(dict(
        batches=(1, 8), prompt_len=128 if small else 512,
        new_tokens=32 if small else 128, repeats=3 if small else 5,
        dtypes=("float32",) if small else ("float32", "bfloat16")))
    c.memory = ml_collections.ConfigDict(dict(budget_gib=16, contexts=(4096, 32768)))
    c.sample = ml_collections.ConfigDict(dict(
        prompt="What is the capital of France? Answer in one sentence.", max_new_tokens=40))
    return c
