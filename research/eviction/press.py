"""KV eviction as a cache: prefill the context in full, keep a budget of it, append the rest.

`EvictingKVCache` implements the core `KVCache` interface. A chunk that starts a sequence
(`start == 0`, more than one token) is that sequence's *context*: it attends to itself in
full (exact prefill, as in SnapKV/H2O-style "prefill then compress" presses), then only
`budget = ceil(ratio * n_context)` of its tokens per KV head are stored, chosen by the
policy (`research.eviction.policies`). Every later chunk (decode steps, a question, a
continuation scored by teacher forcing) is appended in full and attends to the kept
context plus itself. So an evicting cache changes what *later* chunks see; a perplexity
computed inside the prefill chunk (`research.eval.perplexity`) is unchanged by design.

Storage is slot-compacted: kept tokens sit in slots 0..n-1 in position order, each slot
remembering its absolute position per KV head (`pos`, -1 = empty) so RoPE'd keys keep
their true positions and the causal mask stays exact. A per-slot additive logit `bias`
(zero unless a compaction method sets it, e.g. Attention Matching's mass correction)
is part of the state. `init` allocates `max_len` slots so one cache serves any context;
`trim_states` cuts a prefilled state down to what it holds plus room for new tokens,
which is the memory the compressed context really needs (`kept_tokens` counts it).

`evict(policy, ratio)` is the Transform that installs these caches on every dense layer.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from research.core.attention import gqa_scores, masked_softmax_weights
from flax import struct
from research.kv.base import KVCache
from research.kv.codec import FloatCodec
from research.kv.dense import DenseKVCache
from research.eviction.policies import ScoreInputs, make_policy
from research.kv.window import WindowKVCache
from research.transforms import Transform, stateless


def _is_concrete_number(x) -> bool:
    """True for Python/numpy numbers (validated eagerly); False for traced leaves."""
    return isinstance(x, (int, float, np.number)) and not isinstance(x, bool)


def context_budget(n_context: Int[Array, "B"], ratio: float) -> Int[Array, "B"]:
    """Tokens kept per KV head: ceil(ratio * n_context), at least 1, at most n_context."""
    kept = jnp.ceil(n_context.astype(jnp.float32) * ratio - 1e-6).astype(jnp.int32)
    return jnp.clip(kept, jnp.minimum(n_context, 1), n_context)


def attend_per_head(q: Float[Array, "B T Hq D"], k: Float[Array, "B S Hkv D"],
                    v: Float[Array, "B S Hkv D"], q_pos: Int[Array, "B T"],
                    kv_pos: Int[Array, "B S Hkv"], bias: Float[Array, "B S Hkv"],
                    window: int | None) -> tuple[Array, Array]:
    """GQA attention where every KV head has its own slot positions (-1 = empty) and
    additive logit bias. Returns (out [B, T, Hq, D] in q's dtype, weights [B,Hkv,G,T,S])."""
    b, t, hq, d = q.shape
    scores = gqa_scores(q, k) + jnp.transpose(bias, (0, 2, 1))[:, :, None, None, :]
    kp = jnp.transpose(kv_pos, (0, 2, 1))[:, :, None, None, :]  # [B, Hkv, 1, 1, S]
    qp = q_pos[:, None, None, :, None]  # [B, 1, 1, T, 1]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= qp - kp < window
    w = masked_softmax_weights(scores, mask)
    out = jnp.einsum("bkgts,bskd->btkgd", w, v.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype), w


def _rank_desc(scores: Float[Array, "B T H"]) -> Int[Array, "B T H"]:
    """Rank of each token's score within its (row, head), 0 = highest (stable)."""
    order = jnp.argsort(-scores, axis=1, stable=True)
    return jnp.argsort(order, axis=1)


def _scatter_heads(buf: Array, slots: Int[Array, "B T H"], values: Array) -> Array:
    """buf[b, slots[b,t,h], h] = values[b, t, h]; out-of-range slots are dropped."""
    b, t, h = slots.shape
    bi = jnp.broadcast_to(jnp.arange(b)[:, None, None], slots.shape)
    hi = jnp.broadcast_to(jnp.arange(h)[None, None, :], slots.shape)
    return buf.at[bi, slots, hi].set(values.astype(buf.dtype), mode="drop")


@struct.dataclass
class EvictingKVCache(KVCache):
    """Keeps `ratio` of each sequence's context per KV head, chosen by `policy`."""

    policy: object = struct.field(pytree_node=False)
    # A leaf, not a hyper-parameter: every budget (and every layer's salt, which seeds the
    # random policy) shares one compiled program.
    ratio: float = 0.25
    dtype: str = struct.field(pytree_node=False, default="float32")
    salt: Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    def __post_init__(self):
        if isinstance(self.ratio, (str, bytes)) or (
                _is_concrete_number(self.ratio) and not 0.0 < float(self.ratio) <= 1.0):
            raise ValueError(f"ratio (fraction of context KV kept) must be in (0, 1], "
                             f"got {self.ratio!r}")
        if jnp.dtype(self.dtype) not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        make_policy(self.policy)  # validates the policy object

    def init(self, batch, max_len, n_kv_heads, head_dim):
        shape = (batch, max_len, n_kv_heads, head_dim)
        return {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype),
                "pos": jnp.full(shape[:3], -1, jnp.int32),
                "bias": jnp.zeros(shape[:3], jnp.float32),
                "n": jnp.zeros((batch,), jnp.int32)}

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        b, t = q.shape[:2]
        n_slots, hkv = state["k"].shape[1], state["k"].shape[2]
        k, v = k.astype(self.dtype), v.astype(self.dtype)  # chunk seen at storage precision
        q_pos = start[:, None] + jnp.arange(t)[None, :]
        new_valid = jnp.arange(t)[None, :] < n_new[:, None]
        chunk_pos = jnp.where(new_valid, q_pos, -1)[:, :, None] * jnp.ones((hkv,), jnp.int32)
        out, w = attend_per_head(
            q, jnp.concatenate([state["k"], k], axis=1), jnp.concatenate([state["v"], v], 1),
            q_pos, jnp.concatenate([state["pos"], chunk_pos], axis=1),
            jnp.concatenate([state["bias"], jnp.zeros((b, t, hkv), jnp.float32)], axis=1),
            window)
        keep = self._keep(q, k, w[..., n_slots:], new_valid, start, n_new)
        return out, self._append(state, k, v, chunk_pos, keep)

    def _keep(self, q, k, chunk_weights, new_valid, start, n_new):
        """[B, T, Hkv] tokens to store: the policy's budget for a context, else all."""
        keep_all = jnp.broadcast_to(new_valid[:, :, None], k.shape[:3])
        if k.shape[1] == 1:  # a decode step never starts a context worth compressing
            return keep_all
        budget = context_budget(n_new, self.ratio)
        chunk_weights = chunk_weights * new_valid[:, None, None, :, None]  # no padding queries
        inputs = ScoreInputs(q, k, chunk_weights, new_valid, n_new, budget, self.salt)
        scores = self.policy.scores(inputs).astype(jnp.float32)
        scores = jnp.where(new_valid[:, :, None], scores, -jnp.inf)
        chosen = (_rank_desc(scores) < budget[:, None, None]) & keep_all
        is_context = (start == 0)[:, None, None]
        return jnp.where(is_context, chosen, keep_all)

    def _append(self, state, k, v, chunk_pos, keep):
        """Write the kept chunk tokens compactly after each row's `n` used slots."""
        n_slots = state["k"].shape[1]
        rank = jnp.cumsum(keep, axis=1) - 1
        slots = jnp.where(keep, state["n"][:, None, None] + rank, n_slots)
        added = jnp.max(jnp.sum(keep, axis=1), axis=1).astype(jnp.int32)
        return {"k": _scatter_heads(state["k"], slots, k),
                "v": _scatter_heads(state["v"], slots, v),
                "pos": _scatter_heads(state["pos"], slots, chunk_pos),
                "bias": _scatter_heads(state["bias"], slots, jnp.zeros(keep.shape)),
                "n": jnp.minimum(state["n"] + added, n_slots)}

    def describe(self):
        ratio = f"{float(self.ratio):g}" if _is_concrete_number(self.ratio) else "traced"
        return f"evict[{self.policy.name}@{ratio},{jnp.dtype(self.dtype).name}]"


def evict(policy="snapkv", ratio: float = 0.25, *, layer_ratios: Sequence[float] | None = None,
          **policy_options) -> Transform:
    """Transform: every dense-cache layer keeps `ratio` of the context's KV per head.

    policy: a name in `research.eviction.policies.POLICIES` ("streaming_llm", "h2o",
      "snapkv", "random", "knorm") with `policy_options`, or a policy object.
    layer_ratios: optional per-layer ratios (a pyramid or other schedule) instead of one
      `ratio`; one entry per layer. Sliding-window layers keep their ring cache (their
      memory is already bounded). The cache's storage dtype follows the incoming cache.
    """
    policy = make_policy(policy, **policy_options)
    if not _is_concrete_number(ratio):
        raise ValueError(f"ratio (fraction of context KV kept) must be a number in (0, 1], "
                         f"got {ratio!r}")
    EvictingKVCache(policy=policy, ratio=ratio)  # validate now, not at first use

    def apply(model, state):
        ratios = _layer_ratios(ratio, layer_ratios, model.config.n_layers)
        caches = []
        for i, cache in enumerate(model.caches):
            if isinstance(cache, DenseKVCache):
                if not isinstance(cache.codec, FloatCodec):
                    raise TypeError(f"evict would discard layer {i}'s {cache.describe()} "
                                    "cache: a press stores float K/V, not another codec's records")
                cache = EvictingKVCache(policy=policy, ratio=float(ratios[i]),
                                        dtype=cache.codec.dtype,
                                        salt=jnp.asarray(i, jnp.int32))
            elif not isinstance(cache, WindowKVCache):
                raise TypeError(f"evict: layer {i} has a {cache.describe()} cache; eviction "
                                "applies to dense caches (window layers are left as they are)")
            caches.append(cache)
        return model.replace(caches=tuple(caches), tags=model.tags + (f"evict-{policy.name}",))

    return stateless(apply, f"evict({policy.name},{ratio:g})")


def _layer_ratios(ratio, layer_ratios, n_layers) -> list[float]:
    if layer_ratios is None:
        return [ratio] * n_layers
    if len(layer_ratios) != n_layers:
        raise ValueError(f"layer_ratios has {len(layer_ratios)} entries, expected "
                         f"n_layers={n_layers}")
    for r in layer_ratios:
        if not 0.0 < r <= 1.0:
            raise ValueError(f"layer_ratios entries must be in (0, 1], got {r}")
    return [float(r) for r in layer_ratios]


def pyramid_ratios(ratio: float, n_layers: int, spread: float = 0.5) -> tuple[float, ...]:
    """PyramidKV-style schedule: more KV in lower layers, linearly less in upper ones, with
    mean `ratio`; `spread` is the top/bottom difference relative to `ratio` (clipped to (0,1])."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    steps = [(0.5 - i / max(n_layers - 1, 1)) for i in range(n_layers)]
    return tuple(min(1.0, max(1e-3, ratio * (1 + spread * s))) for s in steps)


def is_evicting(state) -> bool:
    return isinstance(state, dict) and {"k", "v", "pos", "bias", "n"} <= set(state)


def kept_tokens(state) -> Int[Array, "B"]:
    """Stored (valid) tokens per row, averaged over KV heads, of one evicting layer state."""
    if not is_evicting(state):
        raise TypeError("kept_tokens expects an EvictingKVCache state")
    return jnp.sum(state["pos"] >= 0, axis=(1, 2)) // state["pos"].shape[2]


def trim_states(states: tuple, room: int) -> tuple:
    """Cut evicting layer states to their used slots + `room` free slots (real arrays, so
    `state_nbytes` of the result is the compressed context's memory); others unchanged."""
    if room < 0:
        raise ValueError(f"room must be >= 0, got {room}")
    out = []
    for s in states:
        if is_evicting(s):
            keep = min(int(jnp.max(s["n"])) + room, s["k"].shape[1])
            s = {name: (a if name == "n" else a[:, :keep]) for name, a in s.items()}
        out.append(s)
    return tuple(out)
