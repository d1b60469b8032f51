"""Disaggregated serving costs: KV-cache size from a model config, its transfer time over a
link, the prompt length past which moving a prefilled KV beats recomputing it, and a
per-second-billing cost line for prefill and decode pools.

    kv_bytes(LLAMA_31_70B, 32768)            # 10.74e9 bytes (bf16): the seed's "~10 GB"
    kv_bytes(LLAMA_31_70B, 32768, bits=1)    # TaSQ 1-bit codes: 0.67e9 bytes
    transfer_s(nbytes, LINKS["6.4 Tbps"])

bits: bits per K/V channel (16 = bf16, 32 = f32, 8 = int8, 1 = TaSQ's 1-bit codes: one
byte code per 8 channels). TaSQ also ships its codebooks once per model, not per request
(`tasq_codebook_bytes`).
"""
from __future__ import annotations

import dataclasses

from research.model.config import ModelConfig

LLAMA_31_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64,
                           n_kv_heads=8, head_dim=128, ffn_dim=28672, rope_theta=500000.0,
                           norm_eps=1e-5, tie_embeddings=False, max_position=131072)

# link rates in bits per second (the seed's RDMA node figure and two common NICs)
LINKS = {"6.4 Tbps": 6.4e12, "400 Gbps": 400e9, "100 Gbps": 100e9}


def _check(config: ModelConfig, tokens: int, bits: float) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    if not bits > 0:
        raise ValueError(f"bits must be > 0 (bits per K/V channel), got {bits!r}")


def kv_bytes_per_token(config: ModelConfig, bits: float = 16) -> float:
    """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * bits / 8."""
    _check(config, 0, bits)
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bits / 8


def kv_bytes(config: ModelConfig, tokens: int, bits: float = 16) -> float:
    """KV-cache bytes of one sequence of `tokens` tokens."""
    _check(config, tokens, bits)
    return kv_bytes_per_token(config, bits) * tokens


def tasq_codebook_bytes(config: ModelConfig, centroids: int = 256, group: int = 8,
                        shared_heads: bool = False) -> int:
    """TaSQ's f32 codebooks (K and V, per layer, per KV head unless shared): sent once per
    model to a decode node, not per request."""
    heads = 1 if shared_heads else config.n_kv_heads
    return 2 * config.n_layers * heads * (config.head_dim // group) * centroids * group * 4


def transfer_s(nbytes: float, link_bps: float, latency_s: float = 0.0) -> float:
    """Seconds to move `nbytes` over a link of `link_bps` bits/s (+ a fixed latency)."""
    if nbytes < 0 or link_bps <= 0 or latency_s < 0:
        raise ValueError(f"need nbytes >= 0, link_bps > 0, latency_s >= 0, got {nbytes=}, "
                         f"{link_bps=}, {latency_s=}")
    return latency_s + nbytes * 8 / link_bps


def crossover_tokens(recompute_s, move_s, max_tokens: int = 1 << 20) -> int | None:
    """Smallest prompt length P (1..max_tokens) with move_s(P) < recompute_s(P), where both
    are functions of P (seconds); None if moving never wins in that range. Binary search
    assumes recompute - move is increasing in P past the crossover (prefill grows at least
    linearly, transfer linearly)."""
    if move_s(max_tokens) >= recompute_s(max_tokens):
        return None
    if move_s(1) < recompute_s(1):
        return 1
    lo, hi = 1, max_tokens  # move >= recompute at lo, < at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if move_s(mid) < recompute_s(mid):
            hi = mid
        else:
            lo = mid
    return hi


@dataclasses.dataclass(frozen=True)
class Pool:
    """A pool of identical GPUs billed per second (price per GPU-hour is an input)."""

    name: str
    gpus: int
    usd_per_gpu_hour: float

    def cost(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        return self.gpus * self.usd_per_gpu_hour * seconds / 3600


def request_cost(prefill_pool: Pool, decode_pool: Pool, ttft_s: float, tpot_s: float,
                 new_tokens: int, decode_batch: int) -> dict:
    """Per-request USD with per-second billing: the prefill pool is busy for the TTFT
    (one prompt at a time), the decode pool for new_tokens steps shared by decode_batch
    requests."""
    if decode_batch < 1 or new_tokens < 0:
        raise ValueError(f"need decode_batch >= 1 and new_tokens >= 0, got {decode_batch=}, "
                         f"{new_tokens=}")
    pre = prefill_pool.cost(ttft_s)
    dec = decode_pool.cost(tpot_s * new_tokens) / decode_batch
    return {"prefill_usd": pre, "decode_usd": dec, "total_usd": pre + dec}
