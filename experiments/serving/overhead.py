r"""Engine overhead: the serving engine's decode speed against the model's own
(`generate.decode_loop`), with the step-time breakdown.

Command:   python -m experiments.run --config=experiments/serving/overhead.py:small
Hardware:  CPU (2 cores): small 4,477 s (compiles included; results/serving_overhead_small/,
           at 724f914, on a slower AMD EPYC).
What:      per KV codec (f32, bf16, TaSQ 1-bit pages) and batch (8, 32): B prompts of
           `prompt_tokens` random ids, `new_tokens` greedy tokens each, in one process.
           Both sides are warmed first: one untimed batch each (its excess over a warm
           batch is the compile-seconds column), then `rounds` interleaved timed rounds
           (generate, engine, engine at 2x max_len), medians. Same work on both sides:
           decode tok/s = B x decode steps / their wall seconds, prefill outside.
           generate: `decode_loop` (one jitted while loop, cache of exactly prompt + new
           tokens); engine: the pure-decode `ServingEngine.step()` calls, prefix cache off.
           The engine also runs at twice `max_len` with the same prompts (live-length
           reads: the median step should not change).
Profile:   the sampler on [max batch, vocab] logits (all greedy, half sampled, and the
           full-vocabulary sort it replaced), and one decode forward as the bf16 page pool
           grows 1x / 4x / 16x at the same live rows.
Expected:  engine decode tok/s >= 0.8x generate's at batch 8 and 32 (issue 34's target);
           the step time at 2x max_len within 10% of the one at max_len.
Nothing here is tuned on an evaluation split: random token prompts, greedy decoding.
"""
import ml_collections

from experiments import common


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.serving.overhead_experiment",
                          run_name=f"serving_overhead_{arg}")
    c.codecs = ("f32", "bf16", "tasq-1bit")
    c.batches = (8, 32)
    c.prompt_tokens = 128
    c.new_tokens = 64 if arg == "small" else 128
    c.rounds = 3 if arg == "small" else 5
    c.max_len = 512
    c.block_size = 16
    c.prefill_chunk = 128
    c.calibration_seqs = 4 if arg == "small" else 16
    c.profile_reps = 10
    return c
