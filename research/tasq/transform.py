"""TaSQ as a servax Transform: calibrate scales, permutations and codebooks; fold; swap in
VQ caches.

    t = tasq(TaSQConfig(bits=1))
    model_q, state = calibrate_and_apply(t, model, CalibrationData.from_ids(ids, 256, 8))

Calibration (through the real model, calibration text only):
  1. statistics: post-RoPE K, V and per-channel query energy of every layer/KV head;
  2. scales (ingredients 1 and 2) -> exactly folded into W_q/W_k/W_v/W_o by `apply`;
  3. channel permutation (ingredient 3) on the scaled K/V;
  4. k-means per channel group (L2 in the scaled space == query-weighted distortion).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from research.core.rope import apply_rope
from research.kv.layouts import replace_codecs
from kernels_pallas.vq_attention.rotated import pair_aligned_order
from research.tasq.cq import CQCodec
from research.tasq.vq import VQCodec
from research.model.llama import Model
from flax import struct
from research.tasq import grouping
from research.tasq.config import TaSQConfig
from research.tasq.fingerprint import check_fingerprint, model_fingerprint
from research.tasq.fold import fold_kv_scales
from research.tasq.kmeans import kmeans
from research.tasq.stats import LayerStats, collect
from research.transforms import CalibrationData, Transform


@struct.dataclass
class TaSQState:
    """Calibration artifacts (arrays stacked over layers) and the model they belong to."""

    key_scale: Array       # [L, Hkv, D] folded into W_k (and 1/x into W_q)
    value_scale: Array     # [L, Hkv, D] folded into W_v (and 1/x into W_o)
    key_perm: Array        # [L, Hkv, D] int32, codec channel order
    value_perm: Array      # [L, Hkv, D]
    key_codebook: Array    # [L, Hc, G, K, g]
    value_codebook: Array  # [L, Hc, G, K, g]
    fingerprint: str = struct.field(pytree_node=False)
    config: TaSQConfig = struct.field(pytree_node=False)


# -- scales ---------------------------------------------------------------------------------

def _normalise(w: np.ndarray, min_scale: float) -> np.ndarray:
    """sqrt(w / mean(w)) per head (mean square 1), clipped to [min_scale, 1 / min_scale]."""
    s = np.sqrt(w / np.maximum(w.mean(axis=-1, keepdims=True), 1e-30))
    return np.clip(s, min_scale, 1.0 / min_scale)


def query_weights(stats: LayerStats) -> np.ndarray:
    """Per-channel key scales [Hkv, D] from query energy, tied across each RoPE pair."""
    d = stats.q_sq.shape[-1]
    return 0.5 * (stats.q_sq + np.roll(stats.q_sq, d // 2, axis=-1))


def output_weights(wo: np.ndarray, n_kv_heads: int, head_dim: int) -> np.ndarray:
    """Per-channel value weights [Hkv, D]: energy of the W_o rows that read each channel."""
    w = np.asarray(wo, np.float32).reshape(n_kv_heads, -1, head_dim, wo.shape[-1])
    return np.sum(w * w, axis=(1, 3))


def head_rms(x: np.ndarray) -> np.ndarray:
    """RMS per head of [N, H, D] -> [H]."""
    return np.sqrt(np.mean(x * x, axis=(0, 2)))


def layer_scales(stats: LayerStats, wo: np.ndarray, config: TaSQConfig):
    """(key_scale, value_scale) [Hkv, D] of one layer: ingredient 1, then ingredient 2."""
    n, hkv, d = stats.k.shape
    ks, vs = np.ones((hkv, d)), np.ones((hkv, d))
    if config.query_weighting:
        ks = _normalise(query_weights(stats), config.min_scale)
        vs = _normalise(output_weights(wo, hkv, d), config.min_scale)
    if config.head_normalization:
        for s, x in ((ks, stats.k), (vs, stats.v)):
            rms = head_rms(x * s[None])
            s *= (rms.mean() / np.maximum(rms, 1e-30))[:, None]
    return ks.astype(np.float32), vs.astype(np.float32)


# -- grouping and codebooks -------------------------------------------------------------------

def _perms(x: np.ndarray, config: TaSQConfig, is_key: bool) -> np.ndarray:
    """[Hkv, D] permutations of scaled data x [N, Hkv, D]; `is_key`: groups of whole RoPE
    pairs (without channel_grouping: pairs in order, `pair_aligned_order`)."""
    n, hkv, d = x.shape
    if not config.channel_grouping:
        order = (pair_aligned_order(d, config.channels_per_code)
                 if is_key and config.key_space == "pre_rope" else np.arange(d))
        return np.tile(order.astype(np.int32), (hkv, 1))
    units = grouping.rope_pair_units(d) if is_key else grouping.channel_units(d)
    g = config.channels_per_code

    def one(data):  # [M, D]
        return grouping.covariance_grouping(np.cov(data, rowvar=False), g, units)

    if config.share_codebooks:
        return np.tile(one(x.reshape(-1, d)), (hkv, 1))
    return np.stack([one(x[:, h]) for h in range(hkv)])


def _grouped_points(x: np.ndarray, perm: np.ndarray, config: TaSQConfig,
                    rng: np.random.Generator) -> np.ndarray:
    """k-means problems [Hc * G, P, g] from scaled data x [N, Hkv, D]."""
    n, hkv, d = x.shape
    g = config.channels_per_code
    xp = np.take_along_axis(x, perm[None], axis=-1).reshape(n, hkv, d // g, g)
    if config.share_codebooks:
        pts = xp.transpose(2, 0, 1, 3).reshape(1, d // g, n * hkv, g)  # pool the heads
    else:
        pts = xp.transpose(1, 2, 0, 3)  # [Hkv, G, N, g]
    m = pts.shape[2]
    if m > config.max_points:
        pts = pts[:, :, np.sort(rng.choice(m, config.max_points, replace=False))]
    return pts.reshape(-1, pts.shape[2], g)


def calibration_keys(stats: LayerStats, config: TaSQConfig, model_config,
                     rng: np.random.Generator) -> np.ndarray:
    """The keys [N, Hkv, D] codebooks are fitted on: pre-RoPE keys, or post-RoPE keys at
    the calibration text's positions ("text") or re-rotated to positions drawn uniformly
    from the served range [0, max_position) ("served"; TaSQConfig says why)."""
    if config.key_space == "pre_rope":
        return stats.k_pre
    if config.calibration_positions == "text":
        return stats.k
    positions = served_positions(len(stats.k_pre), model_config.max_position, rng)
    return np.asarray(apply_rope(jnp.asarray(stats.k_pre)[None], jnp.asarray(positions)[None],
                                 model_config.rope_theta)[0])


def served_positions(n: int, max_position: int, rng: np.random.Generator) -> np.ndarray:
    """`n` positions drawn uniformly from [0, max_position) (int32)."""
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    return rng.integers(0, max_position, size=n).astype(np.int32)


def calibrate_state(model: Model, data: CalibrationData, config: TaSQConfig,
                    progress: bool = False) -> TaSQState:
    c = model.config
    config.check_head_dim(c.head_dim)
    fingerprint = model_fingerprint(model)
    stats = collect(model, data, progress=progress)
    rng = np.random.default_rng(config.seed)
    out = {name: [] for name in ("key_scale", "value_scale", "key_perm", "value_perm")}
    problems = []
    for layer, st in enumerate(stats):
        ks, vs = layer_scales(st, model.params["layers"][layer]["wo"], config)
        keys = calibration_keys(st, config, c, rng)  # scales commute with RoPE
        kx, vx = keys * ks[None], st.v * vs[None]
        # Post-RoPE groups keep rotating pairs together (the pair's angle is per channel),
        # and so does the rotated-table read of pre-RoPE codes (a code fixes whole pairs);
        # rebuilt pre-RoPE codes are rotated after decoding, so any grouping is allowed.
        kp = _perms(kx, config, is_key=config.pair_aligned_keys)
        vp = _perms(vx, config, is_key=False)
        out["key_scale"].append(ks)
        out["value_scale"].append(vs)
        out["key_perm"].append(kp)
        out["value_perm"].append(vp)
        problems += [_grouped_points(kx, kp, config, rng), _grouped_points(vx, vp, config, rng)]
    points = np.concatenate(problems)  # [L * 2 * Hc * G, P, g]
    cents = kmeans(points, config.n_centroids, iters=config.kmeans_iters,
                   key=jax.random.key(config.seed))
    hc = 1 if config.share_codebooks else c.n_kv_heads
    g = c.head_dim // config.channels_per_code
    cents = np.asarray(cents).reshape(c.n_layers, 2, hc, g, config.n_centroids,
                                      config.channels_per_code)
    stack = lambda xs, dt: jnp.asarray(np.stack(xs), dt)  # noqa: E731
    return TaSQState(stack(out["key_scale"], jnp.float32), stack(out["value_scale"], jnp.float32),
                     stack(out["key_perm"], jnp.int32), stack(out["value_perm"], jnp.int32),
                     jnp.asarray(cents[:, 0]), jnp.asarray(cents[:, 1]), fingerprint, config)


# -- apply ------------------------------------------------------------------------------------

def apply_state(model: Model, state: TaSQState, label: str = "tasq") -> Model:
    """Fold the scales into the weights and install one VQ cache per layer."""
    if not isinstance(state, TaSQState):
        raise TypeError(f"state must be a TaSQState, got {type(state).__name__}")
    check_fingerprint(model, state.fingerprint, "this TaSQ state")
    c, cfg = model.config, state.config
    if state.key_codebook.shape[0] != c.n_layers:
        raise ValueError(f"state has {state.key_codebook.shape[0]} layers, model has "
                         f"{c.n_layers}")
    folded = fold_kv_scales(model, state.key_scale, state.value_scale)
    def layer_codec(i):
        if cfg.key_space == "pre_rope":
            return CQCodec(state.key_codebook[i], state.value_codebook[i],
                             rope_theta=c.rope_theta, key_perm=state.key_perm[i],
                             value_perm=state.value_perm[i], label=label,
                             implementation=cfg.implementation, interpret=cfg.interpret,
                             key_read=cfg.key_read)
        return VQCodec.create(state.key_codebook[i], state.value_codebook[i],
                                state.key_perm[i], state.value_perm[i],
                                implementation=cfg.implementation, interpret=cfg.interpret,
                                label=label)

    return replace_codecs(folded, layer_codec, f"tasq({label})", label)


def tasq(config: TaSQConfig = TaSQConfig(), *, label: str = "tasq",
         progress: bool = False) -> Transform:
    """The TaSQ transform (see module docstring); `label` names the caches and the tag."""

    def calibrate(model: Model, data: CalibrationData) -> TaSQState:
        return calibrate_state(model, data, config, progress)

    def apply(model: Model, state: TaSQState) -> Model:
        if state.config != config:
            raise ValueError(f"state was calibrated with {state.config}, this transform has "
                             f"{config}")
        return apply_state(model, state, label)

    return Transform(calibrate, apply, f"{label}({config.bits}b)")


def plain_vq(bits: int = 1, **overrides) -> Transform:
    """Plain VQ baseline: k-means on raw post-RoPE K/V, adjacent channel groups, per-head
    codebooks, none of TaSQ's ingredients. Same codec and read path as TaSQ."""
    cfg = TaSQConfig(bits=bits, query_weighting=False, head_normalization=False,
                     channel_grouping=False, share_codebooks=False,
                     **{"key_space": "post_rope", **overrides})
    return tasq(cfg, label="vq")
