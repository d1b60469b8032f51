"""MegaFlux: skew-aware runtime expert replication for expert-parallel MoE.

    ep_model, _ = calibrate_and_apply(megaflux(mesh, replica_slots=2), model, None)

The transform runs every MoE FFN expert-parallel on `mesh` (`ep_moe_ffn`), re-planning
replicas per step (`plan_replicas`); baselines (static EP, EPLB, capacity), routing-skew
generators, balance metrics and an accelerator step-time model are exported beside it.
"""
from research.megaflux.baselines import EPLB, capacity_plan, eplb_placement, even_split_plan
from research.megaflux.cost_model import (B200, DEEPSEEK_V3_EXPERT, H200, NODES, OLMOE_EXPERT,
                                          SHAPES, LayerShape, NodeConfig, step_times)
from research.megaflux.layer import EPConfig, EPStats, ExpertParallelFFN, ep_moe_ffn
from research.megaflux.metrics import gamma, max_vio, replica_bytes, used_slots
from research.megaflux.planner import (ReplicaPlan, check_layout, device_loads,
                                       instance_counts, plan_replicas, slots_from_budget,
                                       static_plan)
from research.megaflux.skew import SkewSpec, per_device_histograms, synthetic_routing
from research.megaflux.transform import megaflux

__all__ = ["EPConfig", "EPStats", "ExpertParallelFFN", "ReplicaPlan", "ep_moe_ffn",
           "megaflux", "plan_replicas", "static_plan", "device_loads", "instance_counts",
           "check_layout", "slots_from_budget", "EPLB", "capacity_plan", "eplb_placement",
           "even_split_plan", "NODES", "SHAPES", "NodeConfig", "LayerShape", "H200", "B200",
           "DEEPSEEK_V3_EXPERT", "OLMOE_EXPERT", "step_times", "gamma", "max_vio",
           "replica_bytes", "used_slots", "SkewSpec", "synthetic_routing",
           "per_device_histograms"]
