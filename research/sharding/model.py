"""Params, KV caches and whole models on a mesh: `shard_model`, `shard_cache_states`.

    mesh = make_mesh(data=2, tensor=3)                # SmolLM2: 9 q / 3 KV heads -> TP 3
    sharded = shard_model(model, mesh)                # params placed, caches wrapped
    states = sharded.init_cache(batch, max_len)       # born sharded (rows x KV heads)
    logits, states = prefill(sharded, tokens, lengths, states)   # the usual jitted steps

Params follow the logical rules (research/sharding/rules.py): Megatron tensor parallelism
(wq/wk/wv/w_gate/w_up split by columns = heads / FFN columns, wo/w_down by rows, the tied
embedding by vocabulary rows), the batch data-parallel. jit's GSPMD partitioner turns the
row-split matmuls into one all-reduce of activations each; no parameter moves.

Attention is where GSPMD would have to guess (gathers through block tables, VQ codes
decoded per head, Pallas kernels it cannot partition), so every layer's cache is wrapped
in `ShardedKVCache`: its `update_and_attend` is a `shard_map` over (batch, KV heads) in
which the unchanged single-device cache runs on its local rows and heads: no collective
at all, and the platform dispatch still picks the Pallas decode kernel on TPU / GPU.
A paged cache's block pool is split over the data axis: data shard j owns blocks
[j*N/dp, (j+1)*N/dp) and its rows' block tables must point there (`init`'s default
tables do); a row whose table points at another shard's block gets NaN outputs, never a
silent read of the wrong page.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from research.kv.base import KVCache
from research.kv.dense import DenseKVCache
from research.kv.paged import TABLE, PagedKVCache
from research.kv.window import WindowKVCache
from research.sharding.rules import (DEFAULT_RULES, EXPERT, logical_spec, mesh_axes_size,
                                     rules_dict)


# -- params ----------------------------------------------------------------------------

def param_logical_axes(config, params) -> Any:
    """The params pytree with each leaf replaced by its logical axis names."""
    def layer_axes(i: int, p: dict) -> dict:
        out = {"attn_norm": ("embed",), "ffn_norm": ("embed",),
               "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"),
               "wv": ("embed", "kv_heads"), "wo": ("heads", "embed")}
        if config.is_moe(i):
            out.update(router=("embed", "router"),
                       w_gate=("experts", "embed", "expert_ffn"),
                       w_up=("experts", "embed", "expert_ffn"),
                       w_down=("experts", "expert_ffn", "embed"))
        else:
            out.update(w_gate=("embed", "ffn"), w_up=("embed", "ffn"),
                       w_down=("ffn", "embed"))
        unknown = set(p) - set(out)
        if unknown:
            raise ValueError(f"layer {i} has params {sorted(unknown)} with no logical axes; "
                             "add them to research.sharding.param_logical_axes")
        return {k: out[k] for k in p}

    axes = {"embed": ("vocab", "embed"), "final_norm": ("embed",),
            "layers": tuple(layer_axes(i, p) for i, p in enumerate(params["layers"]))}
    if "lm_head" in params:
        axes["lm_head"] = ("embed", "vocab")
    unknown = set(params) - set(axes)
    if unknown:
        raise ValueError(f"params {sorted(unknown)} have no logical axes")
    return axes


def _units(config) -> dict:
    """Indivisible units of the flattened axes (a head is never cut)."""
    return {"heads": config.n_heads, "kv_heads": config.n_kv_heads}


def param_specs(config, params, mesh: Mesh, rules: Sequence = DEFAULT_RULES) -> Any:
    """PartitionSpec per param leaf (divisibility checked, errors name the param)."""
    axes = param_logical_axes(config, params)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    axes_flat = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple) and
                                all(isinstance(a, str) for a in x))
    specs = [logical_spec(ax, rules, mesh, shape=leaf.shape, units=_units(config),
                          what=f"params{jax.tree_util.keystr(path)}")
             for (path, leaf), ax in zip(flat, axes_flat)]
    return jax.tree.unflatten(treedef, specs)


def check_attention_layout(config, mesh: Mesh, rules: Sequence = DEFAULT_RULES) -> None:
    """Query heads and KV heads must split alike (each device holds whole GQA groups)."""
    table = rules_dict(rules)
    if table.get("heads", ()) != table.get("kv_heads", ()):
        raise ValueError(f"rules shard 'heads' over {table.get('heads')} but 'kv_heads' "
                         f"over {table.get('kv_heads')}: GQA groups would be cut")
    tp = mesh_axes_size(mesh, [a for a in table.get("kv_heads", ()) if a in mesh.shape])
    if config.n_kv_heads % tp:
        ok = [d for d in range(1, config.n_kv_heads + 1) if config.n_kv_heads % d == 0]
        raise ValueError(
            f"tensor-parallel degree {tp} does not divide n_kv_heads={config.n_kv_heads} "
            f"(n_heads={config.n_heads}): use a tensor axis in {ok}, or data parallelism "
            "only (tensor=1), or a config whose KV heads divide the device count")


# -- caches ----------------------------------------------------------------------------

def _leading_spec(ndim: int, first, rest: dict | None = None) -> P:
    dims = [first] + [None] * (ndim - 1)
    for i, ax in (rest or {}).items():
        dims[i] = ax
    return P(*dims)


@struct.dataclass
class ShardedKVCache(KVCache):
    """A dense, window or paged cache (any codec) run per (batch, KV head) shard.

    `inner` is the single-device cache; its state is sharded rows x KV heads (dense,
    window) or blocks x KV heads (paged pool; tables by rows). Codec arrays whose leading
    dim is the KV-head count (TaSQ codebooks, channel permutations) are split with the
    heads, the rest replicated."""

    inner: KVCache
    mesh: Mesh = struct.field(pytree_node=False)
    batch_axes: tuple = struct.field(pytree_node=False, default=())
    head_axes: tuple = struct.field(pytree_node=False, default=())

    def __post_init__(self):
        if not isinstance(self.inner, (DenseKVCache, WindowKVCache, PagedKVCache)):
            raise TypeError(f"ShardedKVCache wraps a dense, window or paged cache; got "
                            f"{type(self.inner).__name__} ({self.inner.describe()})")

    # axis helpers
    @property
    def _b(self):
        return None if not self.batch_axes else (
            self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes)

    @property
    def _h(self):
        return None if not self.head_axes else (
            self.head_axes[0] if len(self.head_axes) == 1 else self.head_axes)

    @property
    def dp(self) -> int:
        return mesh_axes_size(self.mesh, self.batch_axes)

    @property
    def tp(self) -> int:
        return mesh_axes_size(self.mesh, self.head_axes)

    def state_specs(self, state) -> dict:
        """Per state leaf: records [B or N, S, Hkv, ...] (and a codec's per-sequence
        rings under "seq", [B, R, Hkv, D]) -> (batch, -, heads); 1-2-D leaves (the paged
        table [B, M], the window ring's positions [B, W], ring positions) -> (batch, -)."""
        def spec(x):
            if x.ndim >= 3:
                return _leading_spec(x.ndim, self._b, {2: self._h})
            return _leading_spec(x.ndim, self._b)
        return jax.tree.map(spec, state)

    def codec_specs(self, n_kv_heads: int):
        return jax.tree.map(
            lambda x: _leading_spec(x.ndim, self._h) if (
                x.ndim >= 1 and x.shape[0] == n_kv_heads and self.tp > 1) else P(),
            self.inner)

    def _check(self, batch: int, n_kv_heads: int, n_blocks: int | None = None):
        if batch % self.dp:
            raise ValueError(f"batch={batch} is not divisible by the data-parallel degree "
                             f"{self.dp} (mesh axes {self.batch_axes}): pad the batch to a "
                             f"multiple of {self.dp}")
        if n_kv_heads % self.tp:
            raise ValueError(f"n_kv_heads={n_kv_heads} is not divisible by the tensor-"
                             f"parallel degree {self.tp} (mesh axes {self.head_axes})")
        if n_blocks is not None and n_blocks % self.dp:
            raise ValueError(f"the paged pool's n_blocks={n_blocks} is not divisible by the "
                             f"data-parallel degree {self.dp}: each data shard owns an "
                             "equal range of blocks")

    def init(self, batch, max_len, n_kv_heads, head_dim):
        shapes = jax.eval_shape(functools.partial(self.inner.init, batch, max_len,
                                                  n_kv_heads, head_dim))
        if isinstance(self.inner, PagedKVCache):
            self._check(batch, n_kv_heads, _pool_size(shapes))
        else:
            self._check(batch, n_kv_heads)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                                 self.state_specs(shapes))
        return jax.jit(functools.partial(self.inner.init, batch, max_len, n_kv_heads,
                                         head_dim), out_shardings=shardings)()

    def update_and_attend(self, state, q, k, v, *, start, n_new, window):
        b, _, hq, _ = q.shape
        hkv = k.shape[2]
        n_pool = _pool_size(state) if isinstance(self.inner, PagedKVCache) else None
        self._check(b, hkv, n_pool)
        act = P(self._b, None, self._h, None)
        row = P(self._b)
        specs = self.state_specs(state)
        inner = self.inner
        paged = isinstance(inner, PagedKVCache)
        batch_axes = self.batch_axes

        def local(cache, state, q, k, v, start, n_new):
            bad = None
            if paged:
                n_local = n_pool // self.dp
                me = _flat_axis_index(batch_axes, self.mesh)
                table = state[TABLE]
                lo = me * n_local
                foreign = (table >= 0) & ((table < lo) | (table >= lo + n_local))
                bad = foreign.any(axis=1)
                state = dict(state, **{TABLE: jnp.where((table >= 0) & ~foreign,
                                                        table - lo, -1)})
            out, new = cache.update_and_attend(state, q, k, v, start=start, n_new=n_new,
                                               window=window)
            if paged:  # the caller's table (global block ids) comes back as it was
                new = dict(new, **{TABLE: table})
                out = jnp.where(bad[:, None, None, None], jnp.nan, out)
            return out, new

        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(self.codec_specs(hkv), specs, act, act, act, row, row),
                           out_specs=(act, specs), check_vma=False)
        return fn(inner, state, q, k, v, start, n_new)

    def truncate(self, state, lengths):
        if isinstance(self.inner, WindowKVCache):
            return self.inner.truncate(state, lengths)  # elementwise: GSPMD keeps shards
        return state

    def capacity(self, max_len):
        return self.inner.capacity(max_len)

    def describe(self):
        return f"sharded({self.dp}x{self.tp})[{self.inner.describe()}]"


def _pool_size(state: dict) -> int:
    """Blocks in a paged layer state's pools (records only: not the table, not "seq")."""
    from research.kv.codec import SEQ
    return next(x for n, x in state.items() if n not in (TABLE, SEQ)).shape[0]


def _flat_axis_index(axes: tuple, mesh: Mesh):
    """Row-major index of this shard over several mesh axes (0 when there are none)."""
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
    return idx


# -- whole model -----------------------------------------------------------------------

def place(x, sharding: NamedSharding) -> jax.Array:
    """`x` laid out by `sharding`; under jax.distributed (a sharding with other processes'
    devices) every process passes the same value and keeps its own shards."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _cache_axes(mesh: Mesh, rules) -> tuple[tuple, tuple]:
    table = rules_dict(rules)
    pick = lambda name: tuple(a for a in table.get(name, ()) if mesh.shape.get(a, 1) > 1)  # noqa: E731
    if pick("blocks") != pick("batch"):
        raise ValueError(f"rules shard 'batch' over {pick('batch')} but 'blocks' over "
                         f"{pick('blocks')}: a paged pool is split like the rows it serves")
    return pick("batch"), pick("kv_heads")


def shard_caches(model, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
    """The model with every layer's cache wrapped in a ShardedKVCache on `mesh` (its codec
    arrays placed with their specs)."""
    batch_axes, head_axes = _cache_axes(mesh, rules)
    caches = []
    for i, cache in enumerate(model.caches):
        if isinstance(cache, ShardedKVCache):
            cache = cache.inner
        if not isinstance(cache, (DenseKVCache, WindowKVCache, PagedKVCache)):
            raise TypeError(f"layer {i}'s {cache.describe()} cache cannot be sharded: only "
                            "codec caches in a dense, window or paged layout can")
        wrapped = ShardedKVCache(cache, mesh, batch_axes, head_axes)
        specs = wrapped.codec_specs(model.config.n_kv_heads)
        inner = jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)),
                             cache, specs)
        caches.append(wrapped.replace(inner=inner))
    return model.replace(caches=tuple(caches))


def shard_model(model, mesh: Mesh, rules: Sequence = DEFAULT_RULES, *,
                moe_replica_slots: int = 0):
    """`model` on `mesh`: params placed by the logical rules, caches wrapped
    (`ShardedKVCache`) and, for an MoE model on a mesh with an expert axis > 1, every MoE
    FFN run by MegaFlux's expert-parallel layer on that axis (`moe_replica_slots`
    runtime replicas per device; 0 = static EP). Raises ValueError naming the first array
    the mesh cannot split."""
    config = model.config
    check_attention_layout(config, mesh, rules)
    specs = param_specs(config, model.params, mesh, rules)
    params = jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)),
                          model.params, specs)
    model = model.replace(params=params)
    ep_axes = tuple(a for a in rules_dict(rules).get("experts", ()) if mesh.shape.get(a, 1) > 1)
    if config.moe is not None and ep_axes:
        from research.megaflux import ExpertParallelFFN, megaflux
        if len(ep_axes) != 1:
            raise ValueError(f"MegaFlux's EP layer runs on one mesh axis; rules map "
                             f"'experts' to {ep_axes}")
        ffn = config.moe.ffn
        if isinstance(ffn, ExpertParallelFFN):
            if ffn.mesh != mesh or ffn.cfg.axis_name != ep_axes[0]:
                raise ValueError("the model's MoE layers already run expert-parallel on "
                                 "another mesh / axis than the one given")
        else:
            model = megaflux(mesh, replica_slots=moe_replica_slots,
                             axis_name=ep_axes[0]).apply(model, None)
    return shard_caches(model, mesh, rules)


def cache_state_specs(model, states) -> tuple:
    """PartitionSpec per cache-state leaf of a sharded model's `states`."""
    return tuple(c.state_specs(s) if isinstance(c, ShardedKVCache) else
                 jax.tree.map(lambda _: P(), s) for c, s in zip(model.caches, states))


def shard_cache_states(model, states) -> tuple:
    """Existing per-layer cache states (e.g. built on one device) placed the way the
    sharded `model`'s caches expect them."""
    specs = cache_state_specs(model, states)
    out = []
    for i, (c, s, sp) in enumerate(zip(model.caches, states, specs)):
        if not isinstance(c, ShardedKVCache):
            raise TypeError(f"layer {i}'s cache is not sharded: call shard_model first")
        if isinstance(c.inner, PagedKVCache):
            c._check(s[TABLE].shape[0], model.config.n_kv_heads, _pool_size(s))
        else:
            c._check(jax.tree.leaves(s)[0].shape[0], model.config.n_kv_heads)
        out.append(jax.tree.map(lambda x, p: place(x, NamedSharding(c.mesh, p)), s, sp))
    return tuple(out)


def per_device_bytes(tree) -> dict:
    """Bytes of `tree`'s arrays per device: {"max": .., "min": .., "total": ..,
    "per_device": {device id: bytes}} (replicated arrays count on every device)."""
    per = {}
    total = 0
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        total += x.nbytes
        for shard in x.addressable_shards:
            per[shard.device.id] = per.get(shard.device.id, 0) + shard.data.nbytes
    vals = list(per.values()) or [0]
    return {"max": max(vals), "min": min(vals), "total": total, "per_device": per}
