r"""Long context: does a compressed KV cache turn into decode speed at 4k and 8k tokens?

Command:   python -m experiments.run --config=experiments/serving/long_context.py:small
Hardware:  CPU (2 cores): small ~40 minutes (each codec prefills 4 x 8k tokens).
What:      SmolLM2-135M-Instruct (trained to 8k), f32 weights, through the serving engine
           (paged pool, chunked prefill, live-length reads): per context length and KV
           codec, `batch` prompts of `context` real tokens of held-out prose, then
           `decode_steps` greedy decode steps; decode tok/s = batch / median pure-decode
           step. Codecs: bf16, int8, TaSQ 1-bit with pre-RoPE keys (the default) and
           post-RoPE keys (lookup-table scores). KIVI-2 is left out: its full-precision
           ring is per-sequence state the engine's re-bound rows cannot keep (refused by
           name). Also per codec: KV bytes per token, and at an equal KV budget
           (`budget_gib`) how many `context`-token sequences the pool holds (arithmetic on
           the pool's real block bytes). Beside them, the memory XLA plans for one 4 x 8192
           prefill of `generate` in one piece vs in 512-token pieces (compiled memory
           analysis of the real programs, f32 weights, bf16 cache).
Expected:  TaSQ's pool holds ~16x bf16's sequences; whether its decode is faster on this
           CPU depends on whether the step is bound by the KV read (issue 34 target: TaSQ
           >= 2x bf16 decode tok/s at 4 x 8k).
Nothing is tuned or scored here (a-priori settings; prompts from the calibration
split, which no technique is evaluated on).
"""
import ml_collections


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    if arg not in ("small", "full"):
        raise ValueError(f"config arg must be 'small' or 'full', got {arg!r}")
    c = ml_collections.ConfigDict()
    c.experiment = "experiments.serving.long_context_experiment"
    c.run_name = f"serving_long_context_{arg}"
    c.seed = 0
    c.gguf_path = ""
    c.contexts = (4096, 8192)
    c.codecs = ("bf16", "int8", "tasq-1bit", "tasq-1bit-post-rope")
    c.batch = 4
    c.decode_steps = 16 if arg == "small" else 64
    c.block_size = 16
    c.prefill_chunk = 512
    c.min_read_len = 1024
    c.budget_gib = 1.0
    c.calibration_seqs = 4 if arg == "small" else 16
    c.text_split = "calibration"  # speed only: the split techniques calibrate on
    c.memory_batch, c.memory_context = 4, 8192  # the prefill whose planned memory is shown
    return c
