r"""Scale-out: sharded == single device, per-device bytes, data-parallel throughput on
simulated CPU devices (measured), and a roofline scaling table for real slices (modeled).

Commands:  python -m experiments.run --config=experiments/scaleout/scaleout.py:small
           flock /work/bench.lock python -m experiments.run \
               --config=experiments/scaleout/scaleout.py:throughput
Hardware:  CPU, 8 simulated devices (XLA host platform) that share this machine's 2 cores.
           small = parts (1), (2), (4): no timing, 1,670 s on a shared, loaded machine
           (results/scaleout_small/, at 40bfc7c)
           (30-layer SmolLM2 compiles for every mesh); throughput = part (3) alone, the
           timed part (run it holding the machine's bench lock); full = all four with
           more decode steps and timing rounds.
What runs: (1) SmolLM2-135M (embedded GGUF, real weights, f32) with the f32 dense cache,
           a calibrated TaSQ 1-bit cache and the paged cache, sharded data 2 x tensor 3
           (its 9 q / 3 KV heads: TP 3 on 6 devices) and data 8, against one device:
           prefill logits, greedy decode steps (logits and tokens), per-device parameter
           and KV bytes, and the compiled decode step's collectives; (2) the trained MoE
           LM (research/moe, trained here) with MegaFlux's EP layer on data 2 x tensor 2
           x expert 2 and on expert 8; (3) decode and prefill throughput at data-parallel
           1/2/4/8 simulated devices on the same total batch; (4) a roofline model of a
           decode step on v5e-8 and 8xH200 for SmolLM2 and Llama-3.1-8B.
Expected:  max |sharded - single| logits ~1e-4 of logits ~40 (f32 summation order) with
           float caches; with TaSQ's 1-bit codes a few near-tie codes flip (a quantiser
           is discontinuous), which moves logits by up to ~1: reported as the fraction of
           codes written identically; identical greedy tokens, no all-gather of a parameter or KV array; per-device KV bytes = total /
           (dp x tp); measured DP throughput flat or lower (8 simulated devices share 2
           cores: this measures overhead, not speedup); modeled speedups per the roofline.
"""
import ml_collections

from experiments import common


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    small = arg != "full"
    c = common.new_config(arg, "experiments.scaleout.experiment",
                          args=("small", "throughput", "full"), gguf_path=None)
    c.host_devices = 8
    c.parts = {"small": ("equivalence", "moe", "roofline"), "throughput": ("throughput",),
               "full": ("equivalence", "moe", "throughput", "roofline")}[arg]
    c.matmul_precision = "highest"
    c.equiv = ml_collections.ConfigDict(dict(
        batch=8, prompt_len=48, decode_steps=8 if small else 32,
        layouts=((2, 3, 1), (8, 1, 1)),  # (data, tensor, expert)
        caches=("f32", "tasq", "paged"), paged_block_size=16,
        tasq_seq_len=128, tasq_n_seqs=2, tasq_kmeans_iters=4,
        # also run each cache on one device with each row alone (batch 1): how much
        # another batch shape alone changes (XLA:CPU summation order; TaSQ code near-ties)
        batch_control=True))
    c.moe = ml_collections.ConfigDict(dict(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=16, top_k=2,
        expert_ffn_dim=128, seq_len=128, batch_size=16, steps=150 if small else 1500,
        warmup=15, lr=3e-3, replica_slots=1, batch=8, prompt_len=32, decode_steps=8,
        layouts=((2, 2, 2), (1, 1, 8))))
    c.throughput = ml_collections.ConfigDict(dict(
        data_parallel=(1, 2, 4, 8), batch=8, prompt_len=64, max_len=128,
        warmup=1, repeats=5 if small else 15))
    c.roofline = ml_collections.ConfigDict(dict(
        slices=("v5e-8", "8xH200"), models=("SmolLM2-135M", "Llama-3.1-8B"),
        batch=64, context=4096, weight_bytes=2, kv_bytes=2))
    return c
