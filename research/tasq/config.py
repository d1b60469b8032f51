"""TaSQ hyper-parameters (a small frozen dataclass, kept out of global config)."""
from __future__ import annotations

import dataclasses

CODE_BITS = 8  # one uint8 code per channel group


@dataclasses.dataclass(frozen=True)
class TaSQConfig:
    """bits: bits per channel (1 or 2); group_size: channels per code (default 8 // bits,
    so every code is one byte: 1 bit -> 8 channels and 256 centroids, 2 bits -> 4 channels).

    The three ingredients (each switchable for the ablation):
      query_weighting: keys scaled per RoPE pair by sqrt(E[q_c^2]) of the queries that read
        them (and values per channel by their W_o row energy), folded exactly into
        W_q/W_k (W_v/W_o); k-means in the folded space then minimises score distortion;
      head_normalization: per-head scales (also folded) that bring every KV head to a
        common RMS, so one codebook per layer serves all heads;
      channel_grouping: covariance-aware channel permutation inside the codec.
    share_codebooks: one codebook per (layer, group) for all KV heads (the paper's cross-
      head sharing, what head_normalization is for) instead of one per (layer, KV head,
      group). Off by default: on SmolLM2's calibration data a shared codebook raised the
      attention-output error by ~15% relative even with normalisation (the 3 KV heads
      differ too much), and per-head f32 codebooks cost 11.3 MiB for all of SmolLM2 (fixed,
      not per token: 0.07% of a 16 GiB budget). With
      per-head codebooks head_normalization is a no-op (k-means is scale-equivariant).
    key_space: "pre_rope" (the default, chosen on dev) codes keys before RoPE (they
      cluster much better: RoPE spreads each pair over a circle) and the reader rebuilds
      one block of keys at a time from the centroids and rotates it at its positions
      (XLA blockwise path or the Pallas kernel; never a whole-context dense K). Pre-RoPE
      grouping may split RoPE pairs: keys are rotated after decoding, in codec order.
      "post_rope" codes keys after RoPE, so one lookup table per query scores every
      position without rebuilding keys (the faster read, the larger quality loss).
    key_read: how pre-RoPE key codes are scored. "rebuild" (the default): centroids ->
      keys -> RoPE at their positions -> dot, one block at a time. "rotated_table": key
      groups are made of whole RoPE pairs (i, i + D/2) (covariance grouping over pair
      units, or pairs in order without channel_grouping), so one table of query-centroid
      complex products per query serves every position, each token's entries rotated by
      its position's cos/sin (no key rebuilt; kernels_pallas/vq_attention/rotated.py;
      CommVQ's commuting codebooks without constraining the centroids: a 2-D centroid per
      pair is a complex number, which commutes with the rotation). Same scores as
      "rebuild" on the same codes up to float rounding; the pair-aligned grouping can
      change the codes' quality. The XLA read (CPU) uses it; the Pallas kernels rebuild.
      Pre-RoPE keys only (post-RoPE codes already read through plain tables).
    calibration_positions: where post-RoPE key codebooks are fitted. "text": at the
      positions the calibration text had (0 .. its length - 1, e.g. 0-255), so keys that
      later positions rotate elsewhere fall outside them (8k perplexity 549 against bf16's
      12.1 in results/serving_long_context_small). "served": each calibration key is
      re-rotated to a position drawn uniformly from the model's served range
      [0, config.max_position) (exact: RoPE of the pre-RoPE key, and the key scales are
      tied across RoPE pairs so they commute with it). Pre-RoPE codes are position-free,
      so this only changes post-RoPE calibration.
    """

    bits: int = 1
    group_size: int | None = None
    query_weighting: bool = True
    head_normalization: bool = True
    channel_grouping: bool = True
    share_codebooks: bool = False
    kmeans_iters: int = 12
    max_points: int = 8192  # k-means points per problem (random subset beyond this)
    min_scale: float = 0.05  # per-channel scales are clipped to [min_scale, 1/min_scale] x mean
    seed: int = 0
    implementation: str = "auto"
    interpret: bool = False
    # pre-RoPE keys: the smaller perplexity gap on the dev half of the held-out text
    # (+50.0% vs post-RoPE +98.3% over f32; `python -m experiments.run
    # --config=experiments/tasq/tasq.py:dev`, results/tasq_dev/)
    key_space: str = "pre_rope"
    calibration_positions: str = "text"
    key_read: str = "rebuild"

    def __post_init__(self):
        if self.bits not in (1, 2):
            raise ValueError(f"bits must be 1 or 2, got {self.bits}")
        if self.group_size is not None and self.group_size * self.bits != CODE_BITS:
            raise ValueError(f"group_size * bits must be {CODE_BITS} (one uint8 code per "
                             f"group), got group_size={self.group_size}, bits={self.bits}")
        if self.kmeans_iters < 1 or self.max_points < 256:
            raise ValueError(f"kmeans_iters must be >= 1 and max_points >= 256, got "
                             f"{self.kmeans_iters=}, {self.max_points=}")
        if not 0 < self.min_scale <= 1:
            raise ValueError(f"min_scale must be in (0, 1], got {self.min_scale}")
        if self.key_space not in ("post_rope", "pre_rope"):
            raise ValueError(f"key_space must be 'post_rope' or 'pre_rope', got "
                             f"{self.key_space!r}")
        if self.key_read not in ("rebuild", "rotated_table"):
            raise ValueError(f"key_read must be 'rebuild' or 'rotated_table', got "
                             f"{self.key_read!r}")
        if self.key_read == "rotated_table" and self.key_space != "pre_rope":
            raise ValueError(f"key_read='rotated_table' reads pre-RoPE key codes; got "
                             f"key_space={self.key_space!r}")
        if self.calibration_positions not in ("text", "served"):
            raise ValueError(f"calibration_positions must be 'text' or 'served', got "
                             f"{self.calibration_positions!r}")
        if self.implementation not in ("auto", "xla", "pallas"):
            raise ValueError(f"implementation must be 'auto', 'xla' or 'pallas', got "
                             f"{self.implementation!r}")

    @property
    def channels_per_code(self) -> int:
        return self.group_size or CODE_BITS // self.bits

    @property
    def n_centroids(self) -> int:
        return 2 ** (self.bits * self.channels_per_code)

    def check_head_dim(self, head_dim: int) -> None:
        g = self.channels_per_code
        if head_dim % g:
            raise ValueError(f"group_size={g} (bits={self.bits}) must divide head_dim="
                             f"{head_dim}")
        if self.channel_grouping and g % 2 and self.key_space == "post_rope":
            raise ValueError(f"channel_grouping keeps RoPE pairs together, so group_size "
                             f"must be even, got {g}")
        if self.key_read == "rotated_table" and g % 2:
            raise ValueError(f"key_read='rotated_table' codes whole RoPE pairs, so "
                             f"group_size must be even, got {g}")

    @property
    def pair_aligned_keys(self) -> bool:
        """Key groups hold whole RoPE pairs (post-RoPE keys, or the rotated-table read)."""
        return self.key_space == "post_rope" or self.key_read == "rotated_table"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
