"""Baselines: static EP, EPLB-style static redundant experts, capacity-factor dropping.

EPLB (DeepSeek's expert-parallel load balancer, in the homes-fixed form servax uses):
every `interval` steps, from an exponential moving average of *past* loads, give extra
instances to the experts with the highest load per instance (at most one per device),
place each replica (heaviest first) on the least loaded device with a free slot, and
split every expert's tokens evenly over its instances until the next re-plan. It runs on
the host, off the critical path, and its placement is stale when the hot set drifts.

Capacity factor: static EP where each expert processes at most ceil(cf * assignments / E)
assignments per step; the rest are dropped (and counted).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from research.megaflux.planner import EMPTY, ReplicaPlan, check_layout


def eplb_placement(ema_loads: np.ndarray, n_devices: int, replica_slots: int) -> np.ndarray:
    """[D, S] static replica placement from historical loads (EMPTY where unused)."""
    n_experts = ema_loads.shape[0]
    per_device = check_layout(n_experts, n_devices, replica_slots)
    load = np.asarray(ema_loads, np.float64)
    home = np.arange(n_experts) // per_device
    n_inst = np.ones(n_experts)
    for _ in range(n_devices * replica_slots):
        score = np.where(n_inst < n_devices, load / n_inst, -1.0)
        e = int(np.argmax(score))
        if score[e] <= 0:
            break
        n_inst[e] += 1
    slot_expert = np.full((n_devices, replica_slots), EMPTY, np.int64)
    per_inst = load / n_inst
    dev_load = np.bincount(home, weights=per_inst, minlength=n_devices)
    replicas = [e for e in range(n_experts) for _ in range(int(n_inst[e]) - 1)]
    for e in sorted(replicas, key=lambda e: -per_inst[e]):
        ok = ((slot_expert == EMPTY).any(axis=1) & ~(slot_expert == e).any(axis=1)
              & (np.arange(n_devices) != home[e]))
        if not ok.any():
            continue
        d = int(np.argmin(np.where(ok, dev_load, np.inf)))
        slot_expert[d, int(np.argmax(slot_expert[d] == EMPTY))] = e
        dev_load[d] += per_inst[e]
    return slot_expert


def even_split_plan(loads: np.ndarray, slot_expert: np.ndarray) -> ReplicaPlan:
    """Split each expert's assignments evenly over its home and replicas (EPLB routing)."""
    loads = np.asarray(loads, np.int64)
    slot_expert = np.asarray(slot_expert)
    n_inst = 1 + np.bincount(slot_expert[slot_expert >= 0], minlength=loads.shape[0])
    base, extra = loads // n_inst, loads % n_inst
    home_tokens = base + (extra > 0)  # the home takes the first remainder
    slot_tokens = np.zeros(slot_expert.shape, np.int64)
    seen = np.ones(loads.shape[0], np.int64)  # instances assigned so far (home = 1)
    for d, s in zip(*np.nonzero(slot_expert >= 0)):
        e = slot_expert[d, s]
        slot_tokens[d, s] = base[e] + (extra[e] > seen[e])
        seen[e] += 1
    return ReplicaPlan(slot_expert.astype(np.int32), slot_tokens.astype(np.int32),
                       home_tokens.astype(np.int32))


@dataclasses.dataclass
class EPLB:
    """Stateful EPLB baseline: call `step(loads)` once per step, in order."""

    n_devices: int
    replica_slots: int
    interval: int = 10  # re-plan every `interval` steps
    decay: float = 0.9  # EMA decay of past loads
    ema: np.ndarray | None = None
    placement: np.ndarray | None = None
    steps: int = 0

    def step(self, loads: np.ndarray) -> tuple[ReplicaPlan, int]:
        """(plan for this step's loads, number of slots whose expert changed now)."""
        loads = np.asarray(loads, np.float64)
        changed = 0
        if self.placement is None:  # no history yet: no replicas
            self.placement = np.full((self.n_devices, self.replica_slots), EMPTY, np.int64)
        elif self.steps % self.interval == 0:
            new = eplb_placement(self.ema, self.n_devices, self.replica_slots)
            changed = int(((new >= 0) & (new != self.placement)).sum())
            self.placement = new
        plan = even_split_plan(loads, self.placement)
        self.ema = loads if self.ema is None else self.decay * self.ema + (1 - self.decay) * loads
        self.steps += 1
        return plan, changed


def capacity_plan(loads: np.ndarray, n_devices: int, capacity_factor: float
                  ) -> tuple[ReplicaPlan, int]:
    """Static EP keeping at most ceil(cf * mean expert load) per expert; (plan, dropped)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    loads = np.asarray(loads, np.int64)
    cap = int(np.ceil(capacity_factor * loads.sum() / loads.shape[0]))
    kept = np.minimum(loads, cap)
    plan = ReplicaPlan(np.full((n_devices, 0), EMPTY, np.int32),
                       np.zeros((n_devices, 0), np.int32), kept.astype(np.int32))
    return plan, int((loads - kept).sum())
