r"""SpecScale vs best-of-N and beam search on verifiable arithmetic chains (SmolLM2-135M).

Command:   python -m experiments.run --config=experiments/specscale/specscale.py:small
Hardware:  small = CPU (2 cores), 24 problems, ~10 minutes on an idle machine (much longer
           when other jobs share the cores); full = 200 problems + ablations (GPU/TPU
           or a long CPU run).
Expected:  single-sample accuracy well below 1 (the task is "sometimes" solvable); every
           verifier-guided search above it; SpecScale at least 2x the problems/s of beam
           search with per-step verification at equal accuracy (within 1 point), and a
           peak KV-block count well below the no-sharing baseline. The table states the
           95% Wilson interval of every accuracy: with 24 problems it is about +-20
           points, so the small run cannot resolve a 1-point accuracy difference (the
           claims table says so); use `full` for that.
"""
import ml_collections


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    if arg not in ("small", "full"):
        raise ValueError(f"config arg must be 'small' or 'full', got {arg!r}")
    small = arg == "small"
    c = ml_collections.ConfigDict()
    c.experiment = "experiments.specscale.experiment"
    c.run_name = f"specscale_{arg}"
    c.seed = 0
    c.gguf_path = ""  # empty: the embedded SmolLM2-135M-Instruct
    c.task = ml_collections.ConfigDict(dict(
        n_steps=2, start_range=(2, 9), operand_range=(1, 9), n_shots=2, verifier_shots=8))
    c.n_problems = 24 if small else 200
    # problems searched concurrently: their candidates share every forward pass
    c.group_size = 24 if small else 50
    # temperature 0.5 (was 0.8), shared by every sampling method (beam and SpecScale alike),
    # tuned on a dev split (seed 1000, 24 problems; never on the seed-0 test problems):
    #   T    beam 2x4 acc   specscale 2x4 acc   specscale/beam problems/s (tokens computed)
    #   0.8  0.333          0.375               1.6-1.8x (1.9x fewer tokens)
    #   0.5  0.458          0.375               2.1x     (2.5x fewer tokens)
    #   0.3  0.333          0.208               3.7x     (3.2x fewer tokens)
    # 0.5 is the temperature where the beam-search baseline is most accurate; the SpecScale
    # accuracy gaps are 1-4 problems of 24, inside the noise. The dev problems/s ratios were
    # measured on a heavily shared 2-core machine (load 5-7) and are noisy.
    c.engine = ml_collections.ConfigDict(dict(
        block_size=16, max_len=512, temperature=0.5, n_blocks=2048))
    c.limits = ml_collections.ConfigDict(dict(max_lines=4, max_line_tokens=16))
    c.best_of_n = 8
    c.beam = ml_collections.ConfigDict(dict(beam_width=2, expand=4))
    # tuned on a dev split (seed 1000, 16 problems, temperature 0.8): defer=1 was 1.7x
    # beam's problems/s at equal accuracy there, defer=2 only 1.1x (see
    # research/specscale/search.py). Re-checked at temperature 0.5 (seed 1000, 24
    # problems): the pruning thresholds never fire there (-prune, and a looser
    # prune_margin=3 / prune_token_logp=-8 / reject_below=-2, give the same paths), so
    # the gain is dedup's; reject_below=None was less accurate (0.333 vs 0.375). Kept.
    c.specscale = ml_collections.ConfigDict(dict(
        defer=1, reject_below=-1.5, prune_margin=2.0, prune_token_logp=-6.0, dedup=True))
    # SpecScale variants, one switch flipped each ("+defer": deferred verification of
    # 2 lines with rollback); each costs a run, so small runs only the deferral variant
    c.ablations = ("+defer",) if small else ("+defer", "-reject", "-prune", "-dedup")
    # peak KV blocks: beam with and without prefix sharing and SpecScale, on the first
    # `memory_problems` problems (the no-sharing pool copies every fork, so it is big)
    c.memory_problems = 8
    c.no_sharing_n_blocks = 4096
    return c
