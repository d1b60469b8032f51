r"""Long context: does a compressed KV cache turn into decode speed at 4k and 8k tokens?

Command:   python -m experiments.run --config=experiments/serving/long_context.py:small
Hardware:  CPU (2 cores): small ~1 h 40 min alone (5,924 s at 48499e7: one prompt per
           codec and context, the budget's rows, 2 x 8k-token quality windows per codec).
What:      SmolLM2-135M-Instruct (trained to 8k), f32 weights, through the serving engine
           (paged pool, chunked prefill, live-length reads), per context length and KV
           codec: (a) decode tok/s of `batch` rows, (b) engine output tok/s of as many
           rows as `budget_gib` of that codec's pool holds at this context (its real
           block bytes), each over `decode_steps` / `budget_decode_steps` greedy steps.
           Every row is a private copy of one prefilled prompt (ServingEngine.fork: its
           pages and next token copied, no forward, no shared pages), so only one prompt
           per codec and context is prefilled. (c) Each codec's continuation perplexity at the longest
           context: the last 1,024 tokens of 8,192-token windows of the fresh test text.
           Codecs: bf16, int8, TaSQ 1-bit with pre-RoPE keys (the default) and post-RoPE
           keys (lookup-table scores). Plain KIVI-2 is left out: its full-precision ring is
           per-sequence state the engine's re-bound rows cannot keep (refused by name);
           `kivi-2bit+w128` (its residual kept by the bf16 window) is servable.
           Beside them, the memory XLA plans for one 4 x 8192 prefill of `generate` in one
           piece vs in 512-token pieces (compiled memory analysis, f32 weights, bf16
           cache).
Expected:  TaSQ's pool holds ~16x bf16's sequences; whether that turns into throughput
           on this CPU depends on whether the step is bound by the KV read (issue 34
           targets: TaSQ >= 2x bf16 decode tok/s at 4 x 8k; >= 3x engine output tok/s at
           an equal KV budget at 8k).
Nothing is tuned here (a-priori settings; speed prompts from the calibration split,
which no technique is evaluated on; the quality windows are test text, scored once).
"""
import ml_collections

from experiments import common


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.serving.long_context_experiment",
                          run_name=f"serving_long_context_{arg}")
    c.contexts = (4096, 8192)
    c.codecs = ("bf16", "int8", "tasq-1bit", "tasq-1bit-post")
    c.batch = 4
    c.decode_steps = 16 if arg == "small" else 64
    c.block_size = 16
    c.prefill_chunk = 512
    c.min_read_len = 1024
    c.budget_gib = 1.0
    c.budget_decode_steps = 4 if arg == "small" else 16  # steps timed at the budget's rows
    c.max_budget_rows = 0  # 0: as many rows as the budget holds
    # codec quality at the longest context: continuation perplexity on the fresh test
    # text, windows past the tokens earlier fresh-text runs scored (TaSQ, DynaCore,
    # PatchKV: below 8,704 and around 49-51k)
    c.quality = ml_collections.ConfigDict(dict(
        windows=2, length=8192, continuation=1024, offset=12288, batch=2))
    c.calibration_seqs = 4 if arg == "small" else 16
    c.text_split = "calibration"  # speed only: the split techniques calibrate on
    c.memory_batch, c.memory_context = 4, 8192  # the prefill whose planned memory is shown
    return c
