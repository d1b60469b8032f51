"""MegaFlux as a servax Transform: run a model's MoE layers expert-parallel with runtime
replication on a device mesh (no calibration: the plan is made per step, on device)."""
from __future__ import annotations

from jax.sharding import Mesh

from kernels_pallas.grouped_matmul import GroupedMatmul
from research.megaflux.layer import EPConfig, ExpertParallelFFN
from research.megaflux.planner import check_layout
from research.transforms import Transform, stateless


def megaflux(mesh: Mesh, replica_slots: int = 2, *, min_replica_tokens: int = 1,
             transport: str = "auto", matmul: GroupedMatmul = GroupedMatmul(),
             axis_name: str = "ep") -> Transform:
    """A Transform whose models run every MoE FFN through `ep_moe_ffn` on `mesh`.

    replica_slots=0 gives static expert parallelism (the baseline)."""
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis_name!r} (axes: {mesh.axis_names})")

    def apply(model, state):
        moe = model.config.moe
        if moe is None:
            raise ValueError("megaflux needs a model with MoE layers (config.moe is None)")
        check_layout(moe.n_experts, mesh.shape[axis_name], replica_slots)
        cfg = EPConfig(moe.n_experts, moe.top_k, replica_slots=replica_slots,
                       min_replica_tokens=min_replica_tokens, renormalize=moe.renormalize,
                       transport=transport, matmul=matmul, axis_name=axis_name)
        config = model.config.replace(moe=moe.__class__(
            moe.n_experts, moe.top_k, moe.expert_ffn_dim, moe.renormalize,
            ffn=ExpertParallelFFN(mesh, cfg)))
        return model.replace(config=config, tags=model.tags + (f"megaflux(S={replica_slots})",))

    return stateless(apply, f"megaflux(slots={replica_slots})")
