"""Modeled TTFT and TPOT of a dense Llama on one tensor-parallel node (datasheet rates).

Each step's time is its roofline: max(FLOPs / (peak * mfu), bytes / (HBM bw * mbu)),
summed over the node's GPUs as one ideal device (tensor parallel, communication not
modeled). Weight bytes: bf16 = 2 B/param; W8A8 = 1 B; W4A16 = (4 + 32/g + 8/g) / 8 B
(an f32 scale and a uint8 zero point per group of g, as servax stores them). Attention
FLOPs and KV bytes are bf16 in every setting (the KV cache is not what the weight scheme
changes).

Rates (dense, no sparsity; per GPU):
  H200 SXM: BF16 989 TFLOPS, INT8/FP8 1,979 TOPS, HBM3e 4.8 TB/s, 141 GB.
  B200 (HGX): BF16 2,250 TFLOPS, INT8/FP8 4,500 TOPS, HBM3e 8 TB/s, 180 GB.
  (the same datasheet figures research/megaflux/cost_model.py uses for BF16 / HBM.)
Assumptions: mfu 0.6 (achieved fraction of peak in GEMMs) and mbu 0.8 (of HBM bw) for
every scheme; W4A16 prefill runs bf16 GEMMs (weights dequantized per tile), W8A8 prefill
int8 GEMMs. All figures from this module are MODELED, not measured.
"""
from __future__ import annotations

import dataclasses

from research.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    int8_ops: float
    hbm_bw: float  # bytes/s
    hbm_bytes: float


H200 = GPU("H200", 989e12, 1979e12, 4.8e12, 141e9)
B200 = GPU("B200", 2250e12, 4500e12, 8.0e12, 180e9)
GPUS = {"H200": H200, "B200": B200}


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How linear layers run: bytes per weight and the GEMM rate they get."""

    name: str
    weight_bytes: float  # bytes per parameter (scales included)
    int8_gemm: bool  # GEMMs at the int8 rate (W8A8) or the bf16 rate


BF16 = Scheme("bf16", 2.0, False)
W8A8 = Scheme("W8A8", 1.0 + 4 / 4096, True)  # f32 per-channel scale, negligible
W4A16_G64 = Scheme("W4A16 g64", (4 + 32 / 64 + 8 / 64) / 8, False)


def linear_params(c: ModelConfig) -> float:
    """Parameters of every linear layer (attention, FFN, LM head)."""
    attn = c.dim * c.n_heads * c.head_dim * 2 + c.dim * c.n_kv_heads * c.head_dim * 2
    ffn = 3 * c.dim * c.ffn_dim
    return c.n_layers * (attn + ffn) + c.dim * c.vocab_size


def _time(flops, bytes_, gpu: GPU, n_gpus: int, int8: bool, mfu: float, mbu: float):
    rate = (gpu.int8_ops if int8 else gpu.bf16_flops) * n_gpus * mfu
    return max(flops / rate, bytes_ / (gpu.hbm_bw * n_gpus * mbu))


def ttft_s(c: ModelConfig, prompt: int, scheme: Scheme, gpu: GPU, n_gpus: int = 8,
           batch: int = 1, mfu: float = 0.6, mbu: float = 0.8) -> float:
    """Prefill of `batch` prompts of `prompt` tokens: linear GEMMs at the scheme's rate,
    causal attention (QK^T and PV, half the square) at the bf16 rate."""
    lin_flops = 2 * linear_params(c) * prompt * batch
    attn_flops = 2 * 2 * c.n_layers * c.n_heads * c.head_dim * prompt * prompt / 2 * batch
    w_bytes = linear_params(c) * scheme.weight_bytes
    t_lin = _time(lin_flops, w_bytes, gpu, n_gpus, scheme.int8_gemm, mfu, mbu)
    t_attn = attn_flops / (gpu.bf16_flops * n_gpus * mfu)
    return t_lin + t_attn


def tpot_s(c: ModelConfig, batch: int, context: int, scheme: Scheme, gpu: GPU,
           n_gpus: int = 8, mfu: float = 0.6, mbu: float = 0.8,
           kv_bytes_per_token: float | None = None) -> float:
    """One decode step of `batch` sequences at `context` cached tokens: read every weight
    once and every sequence's KV (bf16), GEMM FLOPs 2 * params * batch."""
    kv = kv_bytes_per_token if kv_bytes_per_token is not None else \
        2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
    flops = 2 * linear_params(c) * batch + \
        2 * 2 * c.n_layers * c.n_heads * c.head_dim * context * batch
    bytes_ = linear_params(c) * scheme.weight_bytes + kv * context * batch
    return _time(flops, bytes_, gpu, n_gpus, scheme.int8_gemm, mfu, mbu)
