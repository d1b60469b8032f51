"""Modeled decode-step scaling on a real slice: a roofline per chip plus ring all-reduces.

Per decode step (one token for each of `batch` sequences at `context` tokens), on a
(dp, tp) layout of chips (tp = tensor-parallel degree, dp = data-parallel replicas):

    bytes/chip  = weights / tp  +  KV(batch / dp rows, context) / tp          (HBM reads)
    flops/chip  = 2 * params_matmul * batch / (dp * tp) + attention 4*ctx*H*Dh*batch/(dp*tp)
    compute     = max(bytes / (hbm_bw * hbm_eff), flops / (peak * mfu))
    comm        = 2 all-reduces per layer of the [batch/dp, dim] activations (+1 of
                  8 bytes per row: the argmax over vocab-split logits) over tp chips, ring: 2 (tp-1)/tp * bytes /
                  (link_bw * link_eff) + latency each (0 when tp = 1)
    step        = compute + comm  (no overlap assumed);  tokens/s = batch / step

A layout fits when weights / tp + KV / (dp * tp) <= HBM. Everything here is *modeled*
from datasheet peaks and the stated efficiency assumptions, not measured.

Datasheets: Google Cloud TPU v5e (per chip: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s,
ICI 1,600 Gbps = 200 GB/s per chip); NVIDIA H200 SXM (989 TFLOP/s dense bf16, 141 GB
HBM3e at 4.8 TB/s, NVLink 4: 900 GB/s bidirectional = 450 GB/s per direction).
Assumptions (the same for every row): 80% of HBM bandwidth, 60% of peak FLOP/s, 80% of
link bandwidth, 10 us (ICI) / 15 us (NVLink) per all-reduce.
"""
from __future__ import annotations

import dataclasses

from research.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    link_bw: float  # bytes/s per direction, per chip, into the all-reduce ring
    latency_s: float  # per all-reduce (assumption)
    hbm_eff: float = 0.8
    mfu: float = 0.6
    link_eff: float = 0.8


TPU_V5E = Chip("TPU v5e", peak_flops=197e12, hbm_bytes=16 * 2 ** 30, hbm_bw=819e9,
               link_bw=200e9, latency_s=10e-6)
H200 = Chip("H200 SXM", peak_flops=989e12, hbm_bytes=141e9, hbm_bw=4.8e12, link_bw=450e9,
            latency_s=15e-6)
SLICES = {"v5e-8": (TPU_V5E, 8), "8xH200": (H200, 8)}


def weight_params(c: ModelConfig) -> tuple[int, int]:
    """(matmul params per token, total params): the embedding gather is not a matmul;
    a tied embedding counts once in total and once as the LM head matmul."""
    attn = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim
    ffn = 3 * c.dim * c.ffn_dim
    per_layer = attn + ffn + 2 * c.dim
    head = c.dim * c.vocab_size
    total = c.n_layers * per_layer + head * (1 if c.tie_embeddings else 2) + c.dim
    return c.n_layers * (attn + ffn) + head, total


def kv_bytes_per_token(c: ModelConfig, bytes_per_value: int = 2) -> int:
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * bytes_per_value


def decode_step(c: ModelConfig, chip: Chip, dp: int, tp: int, batch: int, context: int,
                weight_bytes: int = 2, kv_bytes: int = 2) -> dict:
    """Modeled decode step of `batch` rows at `context` tokens on dp x tp chips."""
    if batch % dp:
        raise ValueError(f"batch={batch} must divide by dp={dp}")
    if c.n_kv_heads % tp:
        raise ValueError(f"tp={tp} must divide n_kv_heads={c.n_kv_heads}")
    matmul, total = weight_params(c)
    w_chip = total * weight_bytes / tp
    kv_chip = batch // dp * context * kv_bytes_per_token(c, kv_bytes) / tp
    flops = (2 * matmul * batch / dp + 4 * context * c.n_heads * c.head_dim * c.n_layers
             * batch / dp) / tp
    t_mem = (w_chip + kv_chip) / (chip.hbm_bw * chip.hbm_eff)
    t_flop = flops / (chip.peak_flops * chip.mfu)
    comm = 0.0
    if tp > 1:
        act = batch // dp * c.dim * weight_bytes
        per = 2 * (tp - 1) / tp / (chip.link_bw * chip.link_eff)
        # 2 all-reduces per layer, + the greedy argmax over vocab-split logits: one
        # all-reduce of (max, index) = 8 bytes per row
        comm = (2 * c.n_layers * (act * per + chip.latency_s)
                + (8 * batch // dp * per + chip.latency_s))
    step = max(t_mem, t_flop) + comm
    return {"chips": dp * tp, "dp": dp, "tp": tp, "batch": batch, "context": context,
            "weights_GB_per_chip": w_chip / 1e9, "kv_GB_per_chip": kv_chip / 1e9,
            "fits": w_chip + kv_chip <= chip.hbm_bytes, "t_mem_ms": t_mem * 1e3,
            "t_flops_ms": t_flop * 1e3, "t_comm_ms": comm * 1e3, "step_ms": step * 1e3,
            "tokens_per_s": batch / step, "bound": "memory" if t_mem >= t_flop else "compute"}


def layouts(c: ModelConfig, n_chips: int) -> list[tuple[int, int]]:
    """(dp, tp) layouts with tp dividing the KV heads and dp * tp <= n_chips, using as many
    chips as the head layout allows (SmolLM2's 3 KV heads: tp 3 on 6 of 8 chips)."""
    out = []
    for tp in range(1, n_chips + 1):
        if c.n_kv_heads % tp:
            continue
        out.append((n_chips // tp, tp))
    return out
