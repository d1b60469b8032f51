"""Load-imbalance metrics (PAPERS.md §1) and replica traffic."""
from __future__ import annotations

import numpy as np


def gamma(device_load) -> float:
    """Straggler factor: max device load / mean device load (1.0 = perfectly balanced)."""
    load = np.asarray(device_load, np.float64)
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


def max_vio(expert_load) -> float:
    """MaxVio: max expert load / mean expert load - 1."""
    load = np.asarray(expert_load, np.float64)
    mean = load.mean()
    return float(load.max() / mean - 1.0) if mean > 0 else 0.0


def used_slots(slot_expert) -> int:
    return int((np.asarray(slot_expert) >= 0).sum())


def replica_bytes(slot_expert, expert_bytes: int) -> int:
    """Weight bytes moved to create this step's replicas (one expert copy per used slot)."""
    return used_slots(slot_expert) * int(expert_bytes)
