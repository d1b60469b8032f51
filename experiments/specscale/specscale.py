r"""SpecScale vs best-of-N and beam search on verifiable arithmetic chains (SmolLM2-135M).

Command:   python -m experiments.run --config=experiments/specscale/specscale.py:small
Hardware:  small = CPU (2 cores), 16 test problems, no ablations (952 s measured);
           full = 200 test problems + 5 ablations (6,468 s measured on the 2-core CPU,
           sharing it with another run; minutes on an accelerator); dev = 16 dev problems
           (where the defaults are chosen).
Expected:  2-step single-digit chains (chosen on dev): one sample is mostly wrong; every
           verifier-guided method checks each line with the exact process verifier
           (ProcessVerifier) beside the likelihood verifier; target: the best search beats
           greedy by >= 10 points with non-overlapping 95% Wilson intervals (full), and
           SpecScale reaches that accuracy at >= 2x the problems/s of beam search with
           per-step verification; peak KV blocks well below the no-sharing baseline; the
           SpecScale run with f32, bf16 and TaSQ 1-bit codes in the pages (peak KV bytes).
           With 16 problems the intervals are +-20-25 points.
"""
import ml_collections

from experiments import common

# Task difficulty and search temperature, chosen on the dev split only (seed 1000, 16
# problems hashing into "dev"; `python -m experiments.specscale.dev.difficulty`,
# results/specscale_dev_difficulty/ and results/specscale_dev_2x1digit/), accuracy of
# greedy / one sample (T=0.5) / beam 2x4 with the likelihood + exact process verifiers:
#   3 steps, 2-digit start and operands:  0.00 / 0.06 / 0.00
#   3 steps, 2-digit start, 1-digit ops:  0.00 / 0.00 / 0.00
#   2 steps, 1-digit numbers:             0.31 / 0.25 / 0.75
# With 3 steps no sample of eight holds a correct step often enough for any verifier to
# find it; 2 single-digit steps is the setting where one sample is mostly wrong and the
# verified search finds correct paths (+44 points over greedy on dev).
TASK_STEPS = 2
TASK_START = (2, 9)
TASK_OPERANDS = (1, 9)
TEMPERATURE = 0.5


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    small = arg != "full"
    c = common.new_config(arg, "experiments.specscale.experiment",
                          args=("small", "full", "dev"), seed=1000 if arg == "dev" else 0)
    # dev: where every default below was chosen; small / full: the test split, scored
    # with them (problems of the two splits are disjoint by content: docs/protocol.md)
    c.split = "dev" if arg == "dev" else "test"
    c.task = ml_collections.ConfigDict(dict(
        n_steps=TASK_STEPS, start_range=TASK_START, operand_range=TASK_OPERANDS, n_shots=2,
        verifier_shots=8))
    c.n_problems = 16 if small else 200
    # True: skip every problem another run has scored (the item ledger), for a rerun on
    # problems new to the project (issue 36: `--config.unseen_only=True`)
    c.unseen_only = False
    # problems searched concurrently: their candidates share every forward pass
    c.group_size = 16 if small else 50
    c.engine = ml_collections.ConfigDict(dict(
        block_size=16, max_len=1024, temperature=TEMPERATURE, n_blocks=4096))
    c.limits = ml_collections.ConfigDict(dict(max_lines=TASK_STEPS + 1, max_line_tokens=16))
    c.best_of_n = 8
    c.beam = ml_collections.ConfigDict(dict(beam_width=2, expand=4))
    # every verifier-guided method (best-of-N, beam, SpecScale) also checks each line with
    # the exact process verifier (research/specscale/verifier.py: ProcessVerifier)
    c.process_verifier = True
    c.specscale = ml_collections.ConfigDict(dict(
        defer=1, reject_below=None, prune_margin=2.0, prune_token_logp=-6.0, dedup=True,
        process_prune=True))
    # (small: none, to fit a shared 2-core machine)
    c.ablations = () if small else ("-process_prune", "+defer", "+reject", "-prune", "-dedup")
    # every method first runs once untimed over all problems: JAX compiles each batch shape
    # on first use and that cost differs between methods (measured: subtracting the
    # compile events alone under-counts it)
    c.warmup_pass = True
    # small: only the methods whose problems/s are compared (beam search and SpecScale) get
    # the warm-up pass; the others' accuracies do not depend on it
    c.warmup_methods = ("beam", "specscale") if small else ()
    # peak KV blocks: beam with and without prefix sharing and SpecScale, on the first
    # `memory_problems` problems (the no-sharing pool copies every fork, so it is big)
    c.memory_problems = 4 if small else 8
    c.no_sharing_n_blocks = 4096
    # SpecScale on the same pool holding each KV codec's records in pages: f32, bf16 and
    # TaSQ 1-bit codes (calibrated on the calibration split, never on the task problems)
    # (registry names, research/serving/kv_codecs.py; the committed runs say "float32",
    # "bfloat16": still accepted, common.LEGACY_KV_CODECS)
    c.kv_codecs = ("f32", "bf16", "tasq-1bit")
    c.tasq = ml_collections.ConfigDict(dict(seq_len=256, n_seqs=8, kmeans_iters=10,
                                            max_points=4096))
    return c
