r"""The long-context KV codec frontier: bytes per token vs 8k quality vs decode speed.

Command:   python -m experiments.run --config=experiments/serving/frontier.py:small
           (`smoke`: a 1k context, 3 codecs, 1 window, 1 passkey trial: the plumbing)
Hardware:  CPU (2 cores): small 1,287 s alone at 6f98866 (calibration 130 s, quality
           515 s, passkey 326 s, speed 310 s; 2,211 s at 7c0957c, before TaSQ's encode
           compiled as one loop body and windowed codecs shared their calibration).
           `--config.measure_speed=False`: bytes, quality and passkey only (16 windows of
           7 codecs: 3,466 s, results/serving_frontier_quality_8k_w16).
What:      SmolLM2-135M-Instruct, f32 weights, every KV codec in `codecs`
           (research/serving/kv_codecs.py; calibrated ones on the calibration split), at
           `context` tokens:
           (a) kv_bytes_per_token of the codec's paged block (real arrays) and, for a
           windowed codec, the bf16 window pages an engine row holds;
           (b) quality against the bf16-KV model over `windows` windows of the fresh test
           text: the last `continuation` tokens scored given the rest, the rest computed
           once with exact attention and written into each codec's cache
           (research/eval/encoded_prefix.py: no compounding through a chunked prefill, as
           serving has; experiments/serving/long_context_quality.py runs that),
           KL(bf16 KV || codec), top-1 agreement, continuation perplexity;
           (c) passkey retrieval: `passkey.trials` prompts of ~`context` tokens, the key at
           depths spread over 0-100%, all but the last `passkey.tail` tokens computed
           exactly, the tail and `max_new_tokens` greedy tokens read through the codec;
           (d) decode tok/s of the whole-model paged decode step at `batch` rows x
           `context` (the engine's step without its scheduler), medians of `decode_steps`
           interleaved across codecs;
           (e) tok/s at an equal `budget_gib` KV budget: the rows the budget holds
           (experiments/serving/long_context_experiment.bytes_per_row, window pages
           included); timed at those rows when they are <= `budget_probe_rows`, else timed
           at `budget_probe_rows` and the step at the budget's rows extrapolated linearly
           from the two measured row counts (`budget_modeled` says which).
Expected:  int8 / fp8 near bf16 in quality; 1-bit codecs need the bf16 window to keep
           the model; speed ratios on this CPU move from day to day (the serving README).
Nothing is tuned here: the codecs run at their dev-chosen defaults (window S=4, W=128;
served-position calibration: scripts/dev_tasq_calibration_positions.py).
"""
import ml_collections

from experiments import common

# item 4 of issue 44, with and without the bf16 window where the codec is servable both
# ways (plain KIVI is not servable: its ring is per-sequence state)
DEFAULT_CODECS = ("bf16", "fp8", "int8", "int4", "kivi-2bit+w128", "tasq-2bit",
                  "tasq-1bit", "tasq-1bit+w128", "tasq-1bit-post", "tasq-1bit-post+w128")


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.serving.frontier_experiment",
                          args=("small", "smoke"), run_name=f"serving_frontier_{arg}")
    smoke = arg == "smoke"
    c.split = "test"  # "dev": the pydoc dev half, recorded nowhere
    c.test_text = "stdlib"
    c.reference = "bf16"
    c.codecs = ("bf16", "int8", "tasq-1bit-post+w128") if smoke else DEFAULT_CODECS
    c.context = 1024 if smoke else 8192
    c.lengths = (c.context,)  # the quality items (long_context_quality_experiment.run_items)
    c.windows = 1 if smoke else 2
    c.continuation = 128 if smoke else 512
    c.passkey = ml_collections.ConfigDict(dict(
        trials=1 if smoke else 2, template="plain", max_new_tokens=8, tail=64))
    c.batch = 4
    c.decode_steps = 3 if smoke else 5
    c.block_size = 16
    c.budget_gib = 1.0
    c.budget_probe_rows = 8 if smoke else 16
    c.calibration_seqs = 16
    c.measure_speed = True  # False: bytes, quality and passkey only (more windows in time)
    return c
