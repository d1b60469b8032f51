"""The codecs TaSQ is compared against, as Transforms on the same model and framework.

    int8_kv()          int8 per (token, head), float16 scales             (no calibration;
                       defined in research/kv/quantized.py beside its codec)
    int4_kv()          llama.cpp q4_0: 4-bit per 32-channel group         (no calibration;
                       research/kv/quantized.py)
    fp8_kv(per_head)   e4m3 with static per-tensor / per-head scales,
                       vLLM's kv_cache_dtype="fp8"                        (calibrated)
    kivi_kv(bits=2)    KIVI-style: keys per channel, values per token,
                       full-precision recent window                       (no calibration)
    sign_kv()          QJL-style sign-bit keys + sign-bit values          (no calibration)
    cq_style(bits=1)   CQ-style coupled adjacent channels, pre-RoPE keys,
                       per-head k-means codebooks                         (calibrated)
    plain_vq(bits=1)   research.tasq.transform.plain_vq                   (calibrated)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from flax import struct

from research.kv.layouts import replace_codecs
from research.kv.fp8 import FP8_MAX, FP8Codec
from research.kv.quantized import int4_kv, int8_kv  # noqa: F401 - re-exported baselines
from research.model.llama import Model
from research.tasq.cq import CQCodec
from research.tasq.kivi import KIVICodec
from research.tasq.sign import SignCodec, gaussian_projection
from research.tasq.config import CODE_BITS
from research.tasq.fingerprint import check_fingerprint, model_fingerprint
from research.tasq.kmeans import kmeans
from research.tasq.stats import collect
from research.transforms import CalibrationData, Transform, stateless


def kivi_kv(bits: int = 2, key_group: int = 32, value_group: int = 32,
            residual: int = 128, rollback: int = 0) -> Transform:
    """KIVI codec in every layer, each keeping its layout (dense, window ring or pages).
    `rollback`: deepest exact rollback (extra full-precision ring slots)."""
    KIVICodec(bits=bits, key_group=key_group, value_group=value_group, residual=residual,
              rollback=rollback)  # validates the arguments now, not at apply time

    def apply(model, state):
        codec = KIVICodec(bits=bits, key_group=key_group, value_group=value_group,
                          residual=residual, rollback=rollback)
        return replace_codecs(model, lambda i: codec, "kivi_kv", f"kivi{bits}")

    return stateless(apply, f"kivi({bits}b)")


def sign_kv(seed: int = 0) -> Transform:
    def apply(model, state):
        c = model.config
        keys = jax.random.split(jax.random.key(seed), c.n_layers)
        return replace_codecs(model, lambda i: SignCodec(
            gaussian_projection(keys[i], c.n_kv_heads, c.head_dim)), "sign_kv", "sign")

    return stateless(apply, "sign(1b)")


@struct.dataclass
class CQState:
    key_codebook: Array    # [L, Hkv, G, K, g] over pre-RoPE keys
    value_codebook: Array  # [L, Hkv, G, K, g]
    fingerprint: str = struct.field(pytree_node=False)


def cq_style(bits: int = 1, kmeans_iters: int = 12, max_points: int = 4096,
             seed: int = 0) -> Transform:
    """Coupled quantisation of adjacent channels (8 // bits per code), pre-RoPE keys,
    per-(layer, head, group) codebooks from plain k-means."""
    if bits not in (1, 2):
        raise ValueError(f"bits must be 1 or 2, got {bits}")
    gs = CODE_BITS // bits

    def calibrate(model: Model, data: CalibrationData) -> CQState:
        c = model.config
        if c.head_dim % gs:
            raise ValueError(f"group size {gs} must divide head_dim={c.head_dim}")
        rng = np.random.default_rng(seed)
        stats = collect(model, data)
        probs = []
        for st in stats:
            for x in (st.k_pre, st.v):
                n = x.shape[0]
                pts = x.reshape(n, c.n_kv_heads, c.head_dim // gs, gs).transpose(1, 2, 0, 3)
                if n > max_points:
                    pts = pts[:, :, np.sort(rng.choice(n, max_points, replace=False))]
                probs.append(pts.reshape(-1, pts.shape[2], gs))
        cents = kmeans(np.concatenate(probs), 2 ** CODE_BITS, iters=kmeans_iters,
                       key=jax.random.key(seed))
        cents = np.asarray(cents).reshape(c.n_layers, 2, c.n_kv_heads, c.head_dim // gs,
                                          2 ** CODE_BITS, gs)
        return CQState(jnp.asarray(cents[:, 0]), jnp.asarray(cents[:, 1]),
                       model_fingerprint(model))

    def apply(model: Model, state: CQState) -> Model:
        check_fingerprint(model, state.fingerprint, "this CQ state")
        theta = model.config.rope_theta
        return replace_codecs(model, lambda i: CQCodec(
            state.key_codebook[i], state.value_codebook[i], rope_theta=theta), "cq_style", "cq")

    return Transform(calibrate, apply, f"cq({bits}b)")


@struct.dataclass
class FP8State:
    k_scale: Array  # [L, Hkv] float32
    v_scale: Array  # [L, Hkv]
    fingerprint: str = struct.field(pytree_node=False)


def rope_safe_amax(k_pre: np.ndarray) -> np.ndarray:
    """[Hkv] bound on |post-RoPE key| at any position: the largest RoPE-pair norm of the
    pre-RoPE keys [N, Hkv, D] (rotation keeps each pair's norm; half-split pairs)."""
    half = k_pre.shape[-1] // 2
    norms = np.sqrt(k_pre[..., :half] ** 2 + k_pre[..., half:] ** 2)
    return norms.max(axis=(0, 2))


def fp8_scales(k_pre: np.ndarray, v: np.ndarray, per_head: bool):
    """(k_scale, v_scale) [Hkv] = amax / 448, per KV head or one value for the layer."""
    ka, va = rope_safe_amax(k_pre), np.abs(v).max(axis=(0, 2))
    if not per_head:
        ka, va = np.full_like(ka, ka.max()), np.full_like(va, va.max())
    floor = np.finfo(np.float32).tiny
    return (np.maximum(ka, floor) / FP8_MAX).astype(np.float32), \
        (np.maximum(va, floor) / FP8_MAX).astype(np.float32)


def fp8_kv(per_head: bool = True) -> Transform:
    """FP8 e4m3 K/V (research/kv/fp8.py) with static scales calibrated as amax / 448 per
    KV head (`per_head`) or per layer (vLLM's per-tensor scales)."""

    def calibrate(model: Model, data: CalibrationData) -> FP8State:
        scales = [fp8_scales(st.k_pre, st.v, per_head) for st in collect(model, data)]
        return FP8State(jnp.asarray(np.stack([k for k, _ in scales])),
                        jnp.asarray(np.stack([v for _, v in scales])),
                        model_fingerprint(model))

    def apply(model: Model, state: FP8State) -> Model:
        check_fingerprint(model, state.fingerprint, "this FP8 state")
        return replace_codecs(model, lambda i: FP8Codec(state.k_scale[i], state.v_scale[i],
                                                        per_head=per_head),
                              "fp8_kv", "kv-fp8")

    return Transform(calibrate, apply, f"fp8({'head' if per_head else 'tensor'})")
