"""Step-time model of one expert-parallel MoE layer on an 8-GPU NVLink node.

Per device: each expert instance (home or replica) is one grouped-matmul group whose time
is its roofline max(FLOPs / (peak * mfu), weight bytes / HBM bandwidth); token dispatch,
combine and replica transfers move bytes over the device's NVLink port (full duplex,
`link_bw` per direction, `link_efficiency` achieved) plus a fixed latency per collective.

Forward (the schedule in layer.py):
    t0       = histogram all_gather + plan (planner_s) + latency
    dispatch = max over devices of max(bytes out, bytes in) / bw          (a2a, collective)
    weights  = replica transfers share the links with the dispatch: they finish at
               max over devices of max(out + w_out, in + w_in) / bw
    device d = max(dispatch + resident_d, weights) + replica_d            (overlap)
    combine  = like dispatch;  T_fwd = t0 + max_d(device d) + combine
Backward (reverse): combine^T, then replica groups' backward first, their weight
gradients (grad_bytes per parameter) travel home during the resident groups' backward:
    device d = max(rep_bwd_d + res_bwd_d, max_d' rep_bwd_d' + grad transfer)
    T_bwd = combine + max_d(device d) + dispatch  (backward FLOPs = 2x forward: dX and dW)
Static EP and capacity-factor are the same formulas with no replicas and no planner.

Constants (NodeConfig) are datasheet peaks: NVIDIA H200 SXM (BF16 dense 989 TFLOPS, i.e.
the datasheet's 1,979 "with sparsity" halved; HBM3e 4.8 TB/s; NVLink 4 900 GB/s
bidirectional = 450 GB/s per direction) and HGX B200 (BF16 dense 2,250 TFLOPS, 4,500 with
sparsity; HBM3e 8 TB/s; NVLink 5 1.8 TB/s bidirectional = 900 GB/s per direction). The
achieved fractions (mfu 0.6, link 0.8) and the 15 us collective latency are assumptions,
the same for every method.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from research.megaflux import planner


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    name: str
    n_devices: int
    peak_flops: float  # dense BF16 FLOP/s per GPU
    hbm_bw: float  # bytes/s per GPU
    link_bw: float  # NVLink bytes/s per GPU per direction
    mfu: float = 0.6  # achieved fraction of peak in grouped GEMMs (assumption)
    link_efficiency: float = 0.8  # achieved fraction of NVLink bandwidth (assumption)
    collective_latency_s: float = 15e-6  # per collective launch + sync (assumption)


H200 = NodeConfig("8xH200", 8, peak_flops=989e12, hbm_bw=4.8e12, link_bw=450e9)
B200 = NodeConfig("8xB200", 8, peak_flops=2250e12, hbm_bw=8.0e12, link_bw=900e9)
NODES = {"B200": B200, "H200": H200}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The modeled MoE layer's expert shape (SwiGLU: 3 matrices of dim x ffn)."""

    name: str
    dim: int
    expert_ffn_dim: int
    act_bytes: int = 2  # bf16 tokens on the wire
    weight_bytes: int = 2  # bf16 weights
    grad_bytes: int = 4  # f32 weight gradients reduced to the home expert

    @property
    def expert_params(self) -> int:
        return 3 * self.dim * self.expert_ffn_dim

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * self.weight_bytes

    @property
    def flops_per_assignment(self) -> int:
        return 2 * self.expert_params


# DeepSeek-V3's routed expert (hidden 7168, moe_intermediate_size 2048) and OLMoE-1B-7B's
# (hidden 2048, intermediate 1024), from the models' published configs.
DEEPSEEK_V3_EXPERT = LayerShape("deepseek_v3_expert", 7168, 2048)
OLMOE_EXPERT = LayerShape("olmoe_expert", 2048, 1024)
SHAPES = {s.name: s for s in (DEEPSEEK_V3_EXPERT, OLMOE_EXPERT)}

_instance_counts = jax.jit(planner.instance_counts)


def _group_time(assignments: np.ndarray, node: NodeConfig, shape: LayerShape,
                backward: bool) -> np.ndarray:
    """Roofline time of each group with this many assignments (0 for empty groups)."""
    flops = shape.flops_per_assignment * assignments * (2.0 if backward else 1.0)
    bytes_ = shape.expert_bytes + (shape.expert_params * shape.grad_bytes if backward else 0)
    t = np.maximum(flops / (node.peak_flops * node.mfu), bytes_ / node.hbm_bw)
    return np.where(assignments > 0, t, 0.0)


def step_times(plan: planner.ReplicaPlan, hist: np.ndarray, node: NodeConfig,
               shape: LayerShape, planner_s: float = 0.0) -> dict:
    """Modeled forward/backward seconds of one step with this plan (see module doc)."""
    d = node.n_devices
    if hist.shape[0] != d:
        raise ValueError(f"hist has {hist.shape[0]} source devices, node has {d}")
    per_device = plan.home_tokens.shape[0] // d
    counts = np.asarray(_instance_counts(plan, hist), np.float64)  # [src, dst, group]
    pair = counts.sum(axis=2)
    off = pair * (1 - np.eye(d))  # local assignments do not cross the link
    bw = node.link_bw * node.link_efficiency
    tok = shape.dim * shape.act_bytes
    send, recv = off.sum(axis=1) * tok, off.sum(axis=0) * tok
    lat = node.collective_latency_s
    dispatch = np.max(np.maximum(send, recv)) / bw + lat
    groups = counts.sum(axis=0)  # [dst, group]
    res_f = _group_time(groups[:, :per_device], node, shape, False).sum(axis=1)
    rep_f = _group_time(groups[:, per_device:], node, shape, False).sum(axis=1)
    res_b = _group_time(groups[:, :per_device], node, shape, True).sum(axis=1)
    rep_b = _group_time(groups[:, per_device:], node, shape, True).sum(axis=1)
    slot_expert = np.asarray(plan.slot_expert)
    w_in = (slot_expert >= 0).sum(axis=1) * float(shape.expert_bytes)
    homes = slot_expert[slot_expert >= 0] // per_device
    w_out = np.bincount(homes, minlength=d) * float(shape.expert_bytes)
    has_replicas = bool((slot_expert >= 0).any())
    t0 = lat + (planner_s if slot_expert.shape[1] else 0.0)
    if has_replicas:
        # Only replica holders wait for weights; only homes wait for replica gradients.
        weights = np.max(np.maximum(send + w_out, recv + w_in)) / bw + lat
        fwd_dev = np.where(w_in > 0, np.maximum(dispatch + res_f, weights) + rep_f,
                           dispatch + res_f)
        grad_scale = shape.grad_bytes / shape.weight_bytes
        grads = np.max(np.maximum(w_in, w_out)) * grad_scale / bw + lat
        bwd_dev = rep_b + res_b
        bwd_dev = np.where(w_in > 0, np.maximum(bwd_dev, rep_b + grads), bwd_dev)
        bwd_dev = np.where(w_out > 0, np.maximum(bwd_dev, np.max(rep_b) + grads), bwd_dev)
    else:
        fwd_dev, bwd_dev = dispatch + res_f, res_b
    fwd = t0 + np.max(fwd_dev) + dispatch  # combine moves the same rows back
    bwd = dispatch + np.max(bwd_dev) + dispatch
    return {"fwd_s": float(fwd), "bwd_s": float(bwd), "dispatch_s": float(dispatch),
            "compute_max_s": float(np.max(res_f + rep_f)),
            "replica_in_bytes_max": float(w_in.max()), "replica_out_bytes_max":
            float(w_out.max())}
