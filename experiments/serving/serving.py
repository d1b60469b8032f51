r"""servax serve: latency/throughput of the continuous-batching engine and its server.

Command:   python -m experiments.run --config=experiments/serving/serving.py:small
Hardware:  CPU. small = ~40 minutes on 2 busy cores (4-64 requests per point; the
           tasq section's 64 requests ~25 of them);
           full = the same sections with ~4x the requests and a wider rate sweep.
Sections (one run each, SmolLM2-135M-Instruct, f32 weights):
  sweep      the HTTP server (real uvicorn, streaming /v1/completions) under seeded
             Poisson arrivals over a sweep of rates up to saturation: TTFT/TPOT/ITL
             p50/p90/p99, throughput, goodput under the SLOs below
  batching   continuous vs static batching on the same engine and load (in-process)
  tasq       TaSQ 1-bit vs bf16 KV pages at the same KV-pool byte budget: peak
             concurrent sequences and peak throughput (all requests at t=0)
  prefix     shared-prefix groups: measured hit rate vs the prediction k*r/(k+1),
             TTFT with the prefix cache on vs off, input cost per 1M tokens with cached
             tokens at 0.05x and 0.1x of $2.00/M
  spec       prompt-lookup speculative decoding on/off on repetitive and free-form loads
Expected:  continuous > static throughput with a much lower p99 TTFT; TaSQ holds ~10x
           the sequences of bf16 in the same bytes but its CPU throughput gain is limited
           by compute (decode slots, weights) rather than KV bytes; prefix cache hit rate
           close to the block-rounded prediction; speculation helps only repetitive text.
           Measured numbers and analysis: experiments/serving/README.md.
"""
import ml_collections

from experiments import common


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    small = arg == "small"
    c = common.new_config(arg, "experiments.serving.experiment")
    c.sections = ("sweep", "batching", "tasq", "prefix", "spec")
    c.engine = ml_collections.ConfigDict(dict(
        kv_codec="bf16", n_blocks=128, block_size=16, max_batch=8, max_len=384,
        token_budget=64, prefill_chunk=32, max_queue=1024))
    c.workload = ml_collections.ConfigDict(dict(
        prompt_median=48, prompt_sigma=0.7, output_median=16, output_sigma=0.5,
        max_prompt=192, max_output=48, burstiness=1.0, split="heldout"))
    c.slo = ml_collections.ConfigDict(dict(ttft_s=2.0, tpot_s=0.25))
    c.sweep = ml_collections.ConfigDict(dict(
        rates=(0.5, 1.0, 2.0, 4.0) if small else (0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0,
                                                         8.0, 16.0),
        n_requests=6 if small else 64))
    c.batching = ml_collections.ConfigDict(dict(rate=2.0, n_requests=8 if small else 96))
    # max_batch must sit well above the bf16 pool's capacity (8 sequences of 56 tokens
    # in 32 blocks) so the pool, not the slots, limits concurrency. It was 16 with 16
    # requests until results/serving_small_tasq (where the slots capped both codecs at 16);
    # raised to 64 slots / 64 requests AFTER seeing that test number (a fix of the
    # section's design, disclosed in experiments/serving/README.md).
    c.tasq = ml_collections.ConfigDict(dict(
        budget_bf16_blocks=32, max_batch=64 if small else 160,
        n_requests=64 if small else 128,
        prompt_tokens=48, max_tokens=8 if small else 64, calibration_seqs=4 if small else 16))
    c.prefix = ml_collections.ConfigDict(dict(
        group_sizes=(2, 4) if small else (2, 4, 8), n_requests=8 if small else 64, prefix_tokens=160,
        suffix_tokens=24, max_tokens=2, rate=0.5, price_per_m=2.00,
        cached_price_factors=(0.05, 0.1)))
    c.spec = ml_collections.ConfigDict(dict(
        draft_tokens=4, n_requests=4 if small else 32, rate=float("inf"), max_tokens=24,
        passage_tokens=48))
    return c
