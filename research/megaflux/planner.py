"""Runtime replication planner: pure JAX, traceable under jit, no host round-trip.

Setting: D devices, E experts, expert e lives at home device e // (E / D); each device has S
replica slots. Given this step's routing histogram (token-assignments per expert), choose
which experts get replicas where and how many of each expert's assignments each instance
(home or replica) processes, so the maximum device load is as small as possible.

Algorithm (greedy water-filling to the mean, a fixed number of iterations so it jits):
the target is ceil(total / D). Each iteration takes the most loaded device `hi` and its
largest piece (a home expert's remaining share, or a replica's share), and the least
loaded device `lo` that can take that expert (it has a free slot, already holds a replica
of it, or is its home), and moves min(piece, load[hi] - target, target - load[lo])
assignments. Each move either brings `hi` or `lo` to the target or exhausts a piece, so
2D + E + D*S iterations reach the fixpoint; later iterations are no-ops. Moves smaller
than `min_replica_tokens` that would open a new slot are skipped (a replica's weight
transfer must buy enough compute). Every device runs the same computation on the same
all-gathered histogram, so the plans agree without communication.

Token split: expert e's assignments are ranked globally (by source device, then local
order); instance order is home first, then replica slots in (device, slot) order, and
instance i takes the next `count_i` ranks. `route_to_instances` maps (expert, rank) to the
destination device and its local group (home experts 0..E/D-1, replica slots after).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

EMPTY = -1


class ReplicaPlan(NamedTuple):
    slot_expert: Int[Array, "D S"]  # expert in each replica slot, EMPTY (-1) when unused
    slot_tokens: Int[Array, "D S"]  # assignments routed to each replica slot
    home_tokens: Int[Array, "E"]  # assignments left at each expert's home device

    @property
    def n_devices(self) -> int:
        return self.slot_expert.shape[0]

    @property
    def n_experts(self) -> int:
        return self.home_tokens.shape[0]


def check_layout(n_experts: int, n_devices: int, replica_slots: int) -> int:
    """Validate an expert-parallel layout; returns experts per device."""
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    if n_experts < 1 or n_experts % n_devices:
        raise ValueError(f"n_experts={n_experts} must be a positive multiple of the "
                         f"{n_devices} expert-parallel devices")
    per_device = n_experts // n_devices
    if replica_slots < 0:
        raise ValueError(f"replica_slots must be >= 0, got {replica_slots}")
    if replica_slots > n_experts - per_device:
        raise ValueError(f"replica_slots={replica_slots} exceeds the "
                         f"{n_experts - per_device} experts a device does not own")
    return per_device


def slots_from_budget(budget_bytes: int, expert_bytes: int) -> int:
    """Replica slots that fit a per-device memory budget; an error if none fits."""
    if expert_bytes <= 0:
        raise ValueError(f"expert_bytes must be > 0, got {expert_bytes}")
    if budget_bytes < expert_bytes:
        raise ValueError(f"replica budget of {budget_bytes} bytes per device holds no "
                         f"expert of {expert_bytes} bytes; give at least one expert's "
                         "bytes, or use replica_slots=0 for static expert parallelism")
    return int(budget_bytes // expert_bytes)


def home_of(experts: Array, per_device: int) -> Array:
    return experts // per_device


def static_plan(loads: Int[Array, "E"], n_devices: int, replica_slots: int = 0
                ) -> ReplicaPlan:
    """No replicas: every assignment is processed at its expert's home."""
    return ReplicaPlan(jnp.full((n_devices, replica_slots), EMPTY, jnp.int32),
                       jnp.zeros((n_devices, replica_slots), jnp.int32),
                       loads.astype(jnp.int32))


def device_loads(plan: ReplicaPlan) -> Int[Array, "D"]:
    """Assignments processed per device (home experts + hosted replicas)."""
    d, e = plan.n_devices, plan.n_experts
    home = jnp.sum(plan.home_tokens.reshape(d, e // d), axis=1)
    return home + jnp.sum(plan.slot_tokens, axis=1)


def _move(state, per_device: int, target, min_tokens: int):
    """One water-filling move (see the module docstring)."""
    slot_expert, slot_tokens, home_tokens = state
    d, s = slot_expert.shape
    load = device_loads(ReplicaPlan(slot_expert, slot_tokens, home_tokens))
    hi = jnp.argmax(load)
    # Pieces on hi: its home experts' shares, then its replica slots' shares.
    home_piece = jax.lax.dynamic_slice(home_tokens, (hi * per_device,), (per_device,))
    pieces = jnp.concatenate([home_piece, slot_tokens[hi]])
    best = jnp.argmax(pieces)
    from_home = best < per_device
    expert = jnp.where(from_home, hi * per_device + best,
                       slot_expert[hi, jnp.maximum(best - per_device, 0)])
    piece = pieces[best]
    # Receivers: devices (not hi) that are the expert's home, hold it, or have a free slot.
    holds = slot_expert == expert  # [D, S]
    is_home = jnp.arange(d) == home_of(expert, per_device)
    has_free = jnp.any(slot_expert == EMPTY, axis=1)
    can_take = (is_home | jnp.any(holds, axis=1) | has_free) & (jnp.arange(d) != hi)
    lo = jnp.argmin(jnp.where(can_take, load, jnp.iinfo(jnp.int32).max))
    amount = jnp.minimum(piece, jnp.minimum(load[hi] - target, target - load[lo]))
    opens_slot = ~(is_home[lo] | jnp.any(holds[lo]))
    ok = can_take[lo] & (amount > 0) & ~(opens_slot & (amount < min_tokens))
    amount = jnp.where(ok, amount, 0)
    # Take from hi.
    home_tokens = home_tokens.at[expert].add(jnp.where(from_home, -amount, 0))
    hi_slot = jnp.maximum(best - per_device, 0)
    slot_tokens = slot_tokens.at[hi, hi_slot].add(jnp.where(from_home, 0, -amount))
    slot_expert = slot_expert.at[hi, hi_slot].set(
        jnp.where(slot_tokens[hi, hi_slot] > 0, slot_expert[hi, hi_slot], EMPTY))
    # Give to lo: its home share, its existing replica, or a newly opened slot.
    home_tokens = home_tokens.at[expert].add(jnp.where(is_home[lo], amount, 0))
    existing = jnp.argmax(holds[lo])
    free = jnp.argmax(slot_expert[lo] == EMPTY)
    lo_slot = jnp.where(jnp.any(holds[lo]), existing, free)
    give = ~is_home[lo] & (amount > 0)
    slot_tokens = slot_tokens.at[lo, lo_slot].add(jnp.where(give, amount, 0))
    slot_expert = slot_expert.at[lo, lo_slot].set(
        jnp.where(give, expert, slot_expert[lo, lo_slot]))
    return slot_expert, slot_tokens, home_tokens


def plan_replicas(loads: Int[Array, "E"], n_devices: int, replica_slots: int,
                  min_replica_tokens: int = 1) -> ReplicaPlan:
    """Water-filling replica plan for one step's expert loads (see module docstring)."""
    n_experts = loads.shape[0]
    per_device = check_layout(n_experts, n_devices, replica_slots)
    if min_replica_tokens < 1:
        raise ValueError(f"min_replica_tokens must be >= 1, got {min_replica_tokens}")
    plan = static_plan(loads, n_devices, replica_slots)
    if replica_slots == 0 or n_devices == 1:
        return plan
    loads = loads.astype(jnp.int32)
    target = (jnp.sum(loads) + n_devices - 1) // n_devices
    n_iter = 2 * n_devices + n_experts + n_devices * replica_slots
    state = jax.lax.fori_loop(
        0, n_iter, lambda _, st: _move(st, per_device, target, min_replica_tokens),
        tuple(plan))
    return ReplicaPlan(*state)


def slot_starts(plan: ReplicaPlan) -> Int[Array, "D S"]:
    """First global rank (within its expert) that each replica slot takes."""
    flat_e = plan.slot_expert.reshape(-1)
    flat_t = plan.slot_tokens.reshape(-1)
    j = jnp.arange(flat_e.shape[0])
    earlier_same = (flat_e[None, :] == flat_e[:, None]) & (j[None, :] < j[:, None])
    before = jnp.sum(jnp.where(earlier_same, flat_t[None, :], 0), axis=1)
    home = plan.home_tokens[jnp.maximum(flat_e, 0)]
    return (home + before).reshape(plan.slot_expert.shape)


def route_to_instances(plan: ReplicaPlan, experts: Int[Array, "A"], ranks: Int[Array, "A"]):
    """Destination (device, local group) of assignments with these experts and global ranks.

    Local groups on a device: its home experts 0..E/D-1, then replica slots E/D..E/D+S-1.
    """
    d, s = plan.slot_expert.shape
    per_device = plan.n_experts // d
    at_home = ranks < plan.home_tokens[experts]
    starts = slot_starts(plan).reshape(-1)
    flat_e, flat_t = plan.slot_expert.reshape(-1), plan.slot_tokens.reshape(-1)
    if s:
        hit = ((flat_e[None, :] == experts[:, None]) & (ranks[:, None] >= starts[None, :])
               & (ranks[:, None] < (starts + flat_t)[None, :]))  # [A, D*S]
        slot = jnp.argmax(hit, axis=1)
    else:
        slot = jnp.zeros_like(experts)
    device = jnp.where(at_home, home_of(experts, per_device), slot // max(s, 1))
    group = jnp.where(at_home, experts % per_device, per_device + slot % max(s, 1))
    return device.astype(jnp.int32), group.astype(jnp.int32)


def instance_counts(plan: ReplicaPlan, hist: Int[Array, "D E"]) -> Int[Array, "D D G"]:
    """[src, dst, local group] assignment counts implied by a plan and the per-source
    histogram (every device can compute the whole matrix: used for ragged offsets)."""
    d, s = plan.slot_expert.shape
    e = plan.n_experts
    per_device = e // d
    src_lo = jnp.cumsum(hist, axis=0) - hist  # [D, E] first rank of each source
    src_hi = src_lo + hist
    # Home instance of e covers ranks [0, home_tokens[e]).
    home_cnt = jnp.clip(jnp.minimum(src_hi, plan.home_tokens) - src_lo, 0)  # [D, E]
    counts = jnp.zeros((d, d, per_device + s), jnp.int32)
    homes = home_of(jnp.arange(e), per_device)
    counts = counts.at[:, homes, jnp.arange(e) % per_device].add(home_cnt)
    if s:
        starts = slot_starts(plan)  # [D, S]
        ends = starts + plan.slot_tokens
        ex = jnp.maximum(plan.slot_expert, 0)
        lo = src_lo[:, ex]  # [src, D, S]
        hi = src_hi[:, ex]
        rep = jnp.clip(jnp.minimum(hi, ends[None]) - jnp.maximum(lo, starts[None]), 0)
        rep = jnp.where(plan.slot_expert[None] >= 0, rep, 0)
        counts = counts.at[:, :, per_device:].add(rep)
    return counts
