"""Model configuration: a frozen, hashable description of a Llama-family decoder.

It is static under `jit` (it goes into pytree metadata), so every field must be
hashable: tuples, not lists.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

GLOBAL = "global"
SLIDING = "sliding"
ATTENTION_KINDS = (GLOBAL, SLIDING)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Top-k routed mixture-of-experts FFN (dropless)."""

    n_experts: int
    top_k: int
    expert_ffn_dim: int
    renormalize: bool = True  # renormalise the top-k router probabilities to sum to 1
    # Optional replacement for `layers.moe_ffn` with the same signature
    # (x [N, D], layer params, top_k, renormalize) -> (y [N, D], Routing), e.g. an
    # expert-parallel layer or a grouped-matmul kernel. None: the ragged_dot reference.
    # Must be hashable (a module-level function), since the config is static under jit.
    ffn: Callable | None = None

    def __post_init__(self):
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.expert_ffn_dim < 1:
            raise ValueError(f"expert_ffn_dim must be >= 1, got {self.expert_ffn_dim}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_position: int = 8192
    # One entry per layer; None means every layer is global.
    layer_kinds: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # None: dense SwiGLU FFN in every layer. Otherwise the FFN of the layers in
    # `moe_layers` (all layers when None) is a routed MoE.
    moe: MoEConfig | None = None
    moe_layers: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_kinds is not None:
            if len(self.layer_kinds) != self.n_layers:
                raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries, "
                                 f"expected n_layers={self.n_layers}")
            bad = set(self.layer_kinds) - set(ATTENTION_KINDS)
            if bad:
                raise ValueError(f"layer_kinds entries must be in {ATTENTION_KINDS}, got {bad}")
            if SLIDING in self.layer_kinds and (self.sliding_window or 0) < 1:
                raise ValueError("sliding layers need sliding_window >= 1, "
                                 f"got {self.sliding_window}")
        if self.moe_layers is not None:
            if self.moe is None:
                raise ValueError("moe_layers is set but moe is None")
            bad = [i for i in self.moe_layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(f"moe_layers {bad} out of range [0, {self.n_layers})")

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kind(self, layer: int) -> str:
        return GLOBAL if self.layer_kinds is None else self.layer_kinds[layer]

    def window(self, layer: int) -> int | None:
        """Attention window of a layer in tokens, or None for global attention."""
        return self.sliding_window if self.kind(layer) == SLIDING else None

    def is_moe(self, layer: int) -> bool:
        if self.moe is None:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def with_interleaved_attention(self, window: int, globals_every: int) -> "ModelConfig":
        """Every `globals_every`-th layer global, the rest sliding (e.g. 4 -> 3:1)."""
        if globals_every < 1:
            raise ValueError(f"globals_every must be >= 1, got {globals_every}")
        kinds = tuple(GLOBAL if (i + 1) % globals_every == 0 else SLIDING
                      for i in range(self.n_layers))
        return self.replace(layer_kinds=kinds, sliding_window=window)


def tiny_config(**overrides) -> ModelConfig:
    """A small random-weight configuration for fast unit tests."""
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                ffn_dim=64, rope_theta=10000.0, norm_eps=1e-5, max_position=512)
    base.update(overrides)
    return ModelConfig(**base)
