"""Expert-parallel MoE FFN with skew-aware runtime expert replication (MegaFlux).

Layout: a 1-D mesh axis (default "ep") of D devices. Tokens are sharded over the axis
(each device routes its own n = N/D tokens); expert e's weights live on its home device
e // (E/D); every device has S replica slots. Dropless.

Per step, on every device (inside one shard_map):

  1. route          top-k routing of the tokens (outside the shard_map; XLA keeps it
                    sharded like the tokens), or replayed routing traces.
  2. histogram      local expert histogram -> all_gather -> [D, E]; loads = sum over D.
  3. plan           planner.plan_replicas(loads): identical on all devices, no host trip.
  4. transfer  (a)  replica weights: D-1 collective permutes, home -> replica slots.
  5. dispatch  (b)  assignments -> (device, local group) by global rank; all_to_all
                    (padded) or ragged_all_to_all; the received rows are sorted by group.
  6. resident  (c)  grouped matmul SwiGLU over the home-expert groups: needs only (b) and
                    local weights, so it is independent of (a).
  7. replica   (d)  grouped matmul over the replica groups: needs (a) and (b).
  8. combine        results back (the reverse all_to_all), weighted sum over top-k.

Schedule (what may overlap): (a) depends only on the plan, so it is issued before (b) and
runs concurrently with the dispatch and with the resident compute (c); only (d) waits for
it. Backward is the transpose, in reverse: the combine's transpose, then the replica
groups' backward (d') first, whose weight gradients travel home through the transposed
permutes (a') while the resident groups' backward (c') runs; the dispatch's transpose
ends the step. The data dependencies above are all XLA needs to overlap them (async
collectives on GPU/TPU); on the CPU simulation the collectives are synchronous.

Gradients are exact: replica weights are copies (ppermute) of the home weights, so the
autodiff transpose of the permute adds every replica's gradient into its home expert.

Dropless sizing: shapes are static under jit, so buffers are sized for the worst case, a
device sending all its n*k assignments to one peer: the padded path sends [D, n*k] rows
per device, the ragged path receives into D*n*k rows but moves only real ones. A smaller
`capacity` (padded path only) bounds memory; overflowing assignments are then dropped and
counted in EPStats.dropped, never silently. (A two-pass alternative, reading the exact
counts on the host before dispatch, would add a host round-trip per step.)
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from kernels_pallas.grouped_matmul import GroupedMatmul
from research.megaflux import planner, transport
from research.model import layers


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """An expert-parallel MoE layer (hashable: static under jit)."""

    n_experts: int
    top_k: int
    replica_slots: int = 0  # per device; 0 = static expert parallelism
    min_replica_tokens: int = 1  # smallest share worth a replica's weight transfer
    renormalize: bool = True
    capacity: int | None = None  # padded rows per (src, dst) pair; None = dropless worst case
    transport: str = "auto"  # "padded" | "ragged" | "ragged_emulated" | "auto" (by platform)
    matmul: GroupedMatmul = GroupedMatmul()
    axis_name: str = "ep"

    def __post_init__(self):
        # Types first: a float here (capacity=1.25) would otherwise fail deep inside JAX.
        for name in ("n_experts", "top_k", "replica_slots", "min_replica_tokens", "capacity"):
            value = getattr(self, name)
            if name == "capacity" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                expected = "None (dropless) or an int" if name == "capacity" else "an int"
                raise TypeError(f"EPConfig.{name} must be {expected}, got {value!r} "
                                f"({type(value).__name__})")
            object.__setattr__(self, name, int(value))  # numpy ints -> int (hashable, static)
        if not isinstance(self.renormalize, (bool, np.bool_)):
            raise TypeError(f"EPConfig.renormalize must be a bool, got {self.renormalize!r}")
        object.__setattr__(self, "renormalize", bool(self.renormalize))
        if not isinstance(self.transport, str):
            raise TypeError(f"EPConfig.transport must be a str, one of "
                            f"{transport.TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.matmul, GroupedMatmul):
            raise TypeError(f"EPConfig.matmul must be a GroupedMatmul, got "
                            f"{type(self.matmul).__name__}")
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise TypeError(f"EPConfig.axis_name must be a non-empty str (the mesh axis), "
                            f"got {self.axis_name!r}")
        if self.n_experts < 1:
            raise ValueError(f"n_experts must be >= 1, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], "
                             f"got {self.top_k}")
        if self.replica_slots < 0:
            raise ValueError(f"replica_slots must be >= 0, got {self.replica_slots}")
        if self.min_replica_tokens < 1:
            raise ValueError(f"min_replica_tokens must be >= 1, got {self.min_replica_tokens}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be None (dropless) or >= 1, got {self.capacity}")
        if self.transport not in transport.TRANSPORTS:
            raise ValueError(f"transport must be one of {transport.TRANSPORTS}, "
                             f"got {self.transport!r}")


class EPStats(NamedTuple):
    """What happened in one step (replicated across devices)."""

    hist: Int[Array, "D E"]  # per-source-device routing histogram
    plan: planner.ReplicaPlan
    device_load: Int[Array, "D"]  # assignments processed per device
    dropped: Int[Array, ""]  # assignments dropped (only with an explicit capacity)


# ----------------------------------------------------------------------- per-device steps

def _global_ranks(ids: Int[Array, "A"], hist: Int[Array, "D E"], me, n_experts: int):
    """Rank of each local assignment among all assignments to its expert, ordered by
    source device then local position (ids == n_experts marks invalid assignments)."""
    order = jnp.argsort(ids, stable=True)
    counts = jnp.bincount(ids, length=n_experts + 1)
    first = jnp.cumsum(counts) - counts
    local = jnp.zeros_like(ids).at[order].set(jnp.arange(ids.shape[0]) - first[ids[order]])
    before = (jnp.cumsum(hist, axis=0) - hist)[me]  # [E] assignments from earlier sources
    return before[jnp.minimum(ids, n_experts - 1)] + local


def _pack(w_gate, w_up, w_down) -> Array:
    e = w_gate.shape[0]
    return jnp.concatenate([w_gate.reshape(e, -1), w_up.reshape(e, -1),
                            w_down.reshape(e, -1)], axis=1)


def _unpack(packed: Array, dm: int, f: int):
    s = packed.shape[0]
    gate, up, down = jnp.split(packed, [dm * f, 2 * dm * f], axis=1)
    return gate.reshape(s, dm, f), up.reshape(s, dm, f), down.reshape(s, f, dm)


def expert_compute(rows: Float[Array, "M Dm"], groups: Int[Array, "M"], home_w: tuple,
                   replica_w: tuple | None, matmul) -> Array:
    """SwiGLU of received rows by local group (-1 = padding row, output 0).

    Resident groups (home experts) and replica groups are two grouped matmuls: the first
    does not depend on the replica weight transfer, so it can overlap it.
    """
    per_device = home_w[0].shape[0]
    n_groups = per_device + (0 if replica_w is None else replica_w[0].shape[0])
    gid = jnp.where(groups < 0, n_groups, groups)
    order = jnp.argsort(gid, stable=True)
    x_sorted = rows[order]
    sizes = jnp.bincount(gid, length=n_groups + 1)[:n_groups].astype(jnp.int32)
    y = layers.expert_ffn(x_sorted, sizes[:per_device], *home_w, matmul=matmul)
    if replica_w is not None:
        n_resident = jnp.sum(sizes[:per_device])
        x_rep = jnp.roll(x_sorted, -n_resident, axis=0)  # replica rows first
        y_rep = layers.expert_ffn(x_rep, sizes[per_device:], *replica_w, matmul=matmul)
        y = y + jnp.roll(y_rep, n_resident, axis=0)
    return jnp.zeros_like(y).at[order].set(y)


def _dispatch_padded(x_rows, dest, group, keep_mask, compute, *, cfg, n_devices):
    """Padded all_to_all dispatch/compute/combine. Returns (y per assignment, dropped)."""
    a, dm = x_rows.shape
    cap = cfg.capacity or a  # worst case: all my assignments go to one device
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=n_devices + 1)
    first = jnp.cumsum(counts) - counts
    pos = jnp.zeros_like(dest).at[order].set(jnp.arange(a) - first[dest[order]])
    kept = keep_mask & (pos < cap)
    dropped = jnp.sum(keep_mask & ~kept)
    flat = jnp.where(kept, dest * cap + pos, n_devices * cap)
    send_x = jnp.zeros((n_devices * cap, dm), x_rows.dtype).at[flat].set(x_rows, mode="drop")
    send_g = jnp.full((n_devices * cap,), -1, jnp.int32).at[flat].set(group, mode="drop")
    ax = cfg.axis_name
    recv_x = jax.lax.all_to_all(send_x.reshape(n_devices, cap, dm), ax, 0, 0)
    recv_g = jax.lax.all_to_all(send_g.reshape(n_devices, cap), ax, 0, 0)
    y_rows = compute(recv_x.reshape(-1, dm), recv_g.reshape(-1))
    back = jax.lax.all_to_all(y_rows.reshape(n_devices, cap, dm), ax, 0, 0).reshape(-1, dm)
    y = jnp.where(kept[:, None], back[jnp.minimum(flat, n_devices * cap - 1)], 0)
    return y, dropped


def _dispatch_ragged(x_rows, dest, group, keep_mask, compute, *, cfg, n_devices, me,
                     exchange):
    """Ragged all_to_all dispatch/compute/combine (only real rows move)."""
    a, dm = x_rows.shape
    ax = cfg.axis_name
    order = jnp.argsort(dest, stable=True)  # invalid (dest == D) last
    counts = jnp.bincount(dest, length=n_devices + 1)[:n_devices].astype(jnp.int32)
    send_off = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    matrix = jax.lax.all_gather(counts, ax, to="invarying")  # [src, dst]
    land_off = (jnp.cumsum(matrix, axis=0) - matrix)[me]  # where my slice lands at dst
    recv_sizes = matrix[:, me]
    recv_off = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    rows = n_devices * a  # dropless worst case: every device sends all to me
    buf = transport.vary_like
    xs = exchange(x_rows[order], buf(jnp.zeros((rows, dm), x_rows.dtype), x_rows), send_off,
                  counts, land_off, recv_sizes)
    gs = exchange(group[order], buf(jnp.full((rows,), -1, jnp.int32), group), send_off,
                  counts, land_off, recv_sizes)
    y_rows = compute(xs, gs)
    src_off = (jnp.cumsum(matrix, axis=1) - matrix)[:, me]  # my slice's offset at each src
    back = exchange(y_rows, buf(jnp.zeros((a, dm), y_rows.dtype), y_rows), recv_off,
                    recv_sizes, src_off, counts)
    y = jnp.zeros_like(back).at[order].set(back)
    return jnp.where(keep_mask[:, None], y, 0), jnp.int32(0)


def _layer_body(x, expert_ids, weights, valid, w_gate, w_up, w_down, *, cfg: EPConfig,
                n_devices: int, transport_kind: str):
    n, dm = x.shape
    e, k, s = cfg.n_experts, cfg.top_k, cfg.replica_slots
    ax = cfg.axis_name
    me = jax.lax.axis_index(ax)
    ok = jnp.repeat(valid, k)
    ids = jnp.where(ok, expert_ids.reshape(-1), e)  # e = invalid
    hist = jax.lax.all_gather(jnp.bincount(ids, length=e + 1)[:e].astype(jnp.int32), ax,
                              to="invarying")  # the same [D, E] on every device
    loads = jnp.sum(hist, axis=0)
    if s:
        plan = planner.plan_replicas(loads, n_devices, s, cfg.min_replica_tokens)
    else:
        plan = planner.static_plan(loads, n_devices)
    replica_w = None
    if s:  # (a) issued before the dispatch: it only needs the plan
        packed = transport.send_replica_weights(_pack(w_gate, w_up, w_down), plan.slot_expert,
                                                me, axis_name=ax, n_devices=n_devices)
        replica_w = _unpack(packed, dm, w_gate.shape[2])
    ranks = _global_ranks(ids, hist, me, e)
    dest, group = planner.route_to_instances(plan, jnp.minimum(ids, e - 1), ranks)
    dest = jnp.where(ok, dest, n_devices)
    compute = functools.partial(expert_compute, home_w=(w_gate, w_up, w_down),
                                replica_w=replica_w, matmul=cfg.matmul)
    x_rows = x[jnp.arange(n * k) // k]
    if transport_kind == "padded":
        y_assign, dropped = _dispatch_padded(x_rows, dest, group, ok, compute, cfg=cfg,
                                             n_devices=n_devices)
    else:
        if transport_kind == "ragged":
            exchange = functools.partial(jax.lax.ragged_all_to_all, axis_name=ax)
        else:  # every slice is at most one device's n*k assignments
            exchange = functools.partial(transport.ragged_all_to_all_padded, axis_name=ax,
                                         max_slice=n * k)
        y_assign, dropped = _dispatch_ragged(x_rows, dest, group, ok, compute, cfg=cfg,
                                             n_devices=n_devices, me=me, exchange=exchange)
    w = weights.reshape(-1).astype(y_assign.dtype)
    y = jnp.sum((y_assign * w[:, None]).reshape(n, k, dm), axis=1).astype(x.dtype)
    stats = (hist, *plan, planner.device_loads(plan), dropped)
    stats = jax.tree.map(lambda t: t[None], stats)  # leading axis: one copy per device
    return y, stats


# ---------------------------------------------------------------------------- public API

def _check_params(x, params: dict, cfg: EPConfig) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [tokens, dim], got {x.shape=}")
    dm = x.shape[1]
    e = cfg.n_experts
    router = params["router"]
    if router.shape != (dm, e):
        raise ValueError(f"params['router'] must be [dim={dm}, n_experts={e}], "
                         f"got {router.shape}")
    f = params["w_gate"].shape[-1]
    want = {"w_gate": (e, dm, f), "w_up": (e, dm, f), "w_down": (e, f, dm)}
    for name, shape in want.items():
        if params[name].shape != shape:
            raise ValueError(f"params[{name!r}] must be {shape}, got {params[name].shape}")


def ep_moe_ffn(x: Float[Array, "N Dm"], params: dict, mesh: Mesh, cfg: EPConfig,
               valid: Array | None = None, routing: layers.Routing | None = None):
    """Expert-parallel dropless MoE FFN over `mesh` axis `cfg.axis_name`.

    x: [N, Dm] tokens (N need not divide the device count: padded, masked). params: the
    MoE layer's {"router" [Dm, E], "w_gate"/"w_up" [E, Dm, F], "w_down" [E, F, Dm]}.
    valid: optional [N] bool; invalid tokens are not routed (output 0). routing: optional
    precomputed Routing (e.g. replayed traces); default: `layers.route` with the router.
    Returns (y [N, Dm], Routing, EPStats). Same results as `layers.moe_ffn` (f32 tolerance).
    """
    if cfg.axis_name not in mesh.shape:
        raise ValueError(f"mesh has no axis {cfg.axis_name!r} (axes: {mesh.axis_names})")
    _check_params(x, params, cfg)
    n_devices = mesh.shape[cfg.axis_name]
    planner.check_layout(cfg.n_experts, n_devices, cfg.replica_slots)
    kind = transport.resolve_transport(cfg.transport, mesh.devices.flat[0].platform)
    if kind != "padded" and cfg.capacity is not None:
        raise ValueError("capacity applies to the padded transport only; the ragged "
                         "transport is always dropless")
    n = x.shape[0]
    if routing is None:
        routing = layers.route(x, params["router"], cfg.top_k, cfg.renormalize)
    elif routing.expert_ids.shape != (n, cfg.top_k):
        raise ValueError(f"routing.expert_ids must be [N={n}, top_k={cfg.top_k}], "
                         f"got {routing.expert_ids.shape}")
    n_pad = -(-max(n, 1) // n_devices) * n_devices
    valid = jnp.ones((n,), bool) if valid is None else valid.astype(bool)
    pad = lambda t: jnp.pad(t, ((0, n_pad - n),) + ((0, 0),) * (t.ndim - 1))  # noqa: E731
    ax = P(cfg.axis_name)
    body = functools.partial(_layer_body, cfg=cfg, n_devices=n_devices, transport_kind=kind)
    # JAX's Pallas interpreter is not vma-clean inside shard_map (it mixes varying refs with
    # invariant program ids); compiled kernels and the XLA paths keep the check on.
    check_vma = not (cfg.matmul.implementation == "pallas" and cfg.matmul.interpret)
    y, stats = jax.shard_map(body, mesh=mesh, in_specs=(ax,) * 7, out_specs=(ax, ax),
                             check_vma=check_vma)(
        pad(x), pad(routing.expert_ids), pad(routing.weights), pad(valid),
        params["w_gate"], params["w_up"], params["w_down"])
    hist, slot_expert, slot_tokens, home_tokens, load, dropped = stats
    stats = EPStats(hist[0], planner.ReplicaPlan(slot_expert[0], slot_tokens[0],
                                                 home_tokens[0]), load[0], jnp.sum(dropped))
    return y[:n], routing, stats


@dataclasses.dataclass(frozen=True)
class ExpertParallelFFN:
    """`MoEConfig.ffn` drop-in: runs a model's MoE layers expert-parallel on `mesh`."""

    mesh: Mesh
    cfg: EPConfig

    def __call__(self, x, p, top_k: int, renormalize: bool):
        if (top_k, renormalize) != (self.cfg.top_k, self.cfg.renormalize):
            raise ValueError(f"model MoE (top_k={top_k}, renormalize={renormalize}) does not "
                             f"match EPConfig (top_k={self.cfg.top_k}, "
                             f"renormalize={self.cfg.renormalize})")
        y, routing, _ = ep_moe_ffn(x, p, self.mesh, self.cfg)
        return y, routing
