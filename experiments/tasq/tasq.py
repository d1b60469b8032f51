r"""TaSQ vs the 1-bit (and 2/8-bit) KV-cache alternatives on SmolLM2-135M-Instruct.

Command:   python -m experiments.run --config=experiments/tasq/tasq.py:small
Hardware:  small = CPU, 1,148 s on 2 cores (results/tasq_small/, at 45a14e7; 4k calibration
           tokens, 8 perplexity windows of 256); dev 3,212 s (results/tasq_dev/); full =
           CPU/GPU, 32k calibration tokens, 64 windows (no committed run: no time measured).
Expected:  one table over held-out text with every codec and the TaSQ ablation: bits per
           channel from the real cache arrays (1.0 for TaSQ), max batch at a fixed budget
           vs bf16 (~16x at 1 bit), perplexity and attention-output error; 1-bit codecs
           lose a lot of perplexity on a 135M model; TaSQ with pre-RoPE keys has the
           smallest 1-bit gap, TaSQ with post-RoPE keys (the lookup-table fast path) beats
           plain VQ and sign-bit but not CQ-style; decode attention over post-RoPE
           codes (lookup tables) ~1.2-2.3x faster than bf16 on CPU XLA depending on load
           (full decode step ~4x at 32k), over pre-RoPE codes (blockwise rebuild + rotate)
           about bf16 speed at 32k. Measured numbers and analysis:
           experiments/tasq/README.md.
"""
import ml_collections

from experiments import common


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    small = arg != "full"
    c = common.new_config(arg, "experiments.tasq.experiment", args=("small", "full", "dev"))
    # dev: post- vs pre-RoPE keys on the dev half of the held-out text (the default key
    # space is the winner); small / full: every codec on the test half, scored once
    c.split = "dev" if arg == "dev" else "test"
    # test text: "pydoc" (the held-out test half) or "stdlib" (the fresh test text,
    # research/data.py; test runs only)
    c.test_text = "pydoc"
    c.calibration = ml_collections.ConfigDict(dict(
        seq_len=256, n_seqs=16 if small else 128))
    c.tasq = ml_collections.ConfigDict(dict(
        kmeans_iters=10 if small else 20, max_points=4096 if small else 32768))
    c.ppl = ml_collections.ConfigDict(dict(
        window=256, stride=128, batch_size=4, max_windows=8 if small else 64))
    c.attn_error = ml_collections.ConfigDict(dict(n_seqs=2 if small else 8, seq_len=256))
    c.memory = ml_collections.ConfigDict(dict(budget_gib=16.0, context=4096))
    c.timing = ml_collections.ConfigDict(dict(
        contexts=(4096, 16384, 32768), batch=1, warmup=2, repeats=7 if small else 21))
    # small: the rows of the 1-bit comparison (f32, bf16, the three 1-bit baselines, TaSQ in
    # both key spaces), sized for a shared 2-core machine; full: every row (int8, KIVI-2,
    # TaSQ 2-bit and the ablations too)
    c.rows = (("f32", "bf16", "sign-bit (QJL-like keys)", "plain VQ", "CQ-style (pre-RoPE)",
               "TaSQ (1 bit, post-RoPE keys)", "TaSQ (1 bit, pre-RoPE keys)")
              if arg == "small" else ())
    c.kivi = ml_collections.ConfigDict(dict(key_group=32, value_group=32, residual=128))
    return c
