"""MegaFlux: skew-aware runtime expert replication for expert-parallel MoE."""
from research.megaflux.layer import EPConfig, EPStats, ExpertParallelFFN, ep_moe_ffn
from research.megaflux.planner import ReplicaPlan, plan_replicas, static_plan
from research.megaflux.transform import megaflux

__all__ = ["EPConfig", "EPStats", "ExpertParallelFFN", "ReplicaPlan", "ep_moe_ffn",
           "megaflux", "plan_replicas", "static_plan"]
