r"""Run the expert-parallel layer under jax.distributed and check it against the reference.

One process per host (here: CPU processes on localhost, each with `--local_devices`
simulated devices); the mesh spans all processes' devices. Every process builds the same
inputs from the seed, runs the replicated layer (forward and gradients) on global arrays,
gathers the results and compares them with layers.moe_ffn computed locally. Writes a JSON
report to --out.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m \
        experiments.megaflux.distributed_check --process_id=0 --num_processes=2 \
        --coordinator=localhost:12355 --out=/tmp/p0.json   # and process_id=1 likewise
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments import distributed


def _inputs(seed: int, n_tokens: int, dim: int, n_experts: int, ffn: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_tokens, dim)).astype(np.float32)
    x[:, 0] = 1.0 + np.abs(x[:, 0])
    params = {"router": rng.normal(size=(dim, n_experts)),
              "w_gate": rng.normal(size=(n_experts, dim, ffn)) / 4,
              "w_up": rng.normal(size=(n_experts, dim, ffn)) / 4,
              "w_down": rng.normal(size=(n_experts, ffn, dim)) / 5}
    params["router"][0, 3] += 3.0  # a hot expert, so replicas are planned
    return x, {k: v.astype(np.float32) for k, v in params.items()}


def _loss_fn(ffn):
    def loss(x, p):
        y = ffn(x, p)[0]
        return jnp.sum(jnp.sin(y) * jnp.arange(1, y.shape[1] + 1)), y
    return loss


def run_check(args) -> dict:
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from research.megaflux import EPConfig, ep_moe_ffn
    from research.model import layers

    mesh = jax.make_mesh((jax.device_count(),), ("ep",), axis_types=(AxisType.Auto,))
    x_np, p_np = _inputs(args.seed, args.n_tokens, 16, args.n_experts, 24)

    def global_array(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                            lambda idx: a[idx])

    x = global_array(x_np, P("ep"))
    p = {k: global_array(v, P() if k == "router" else P("ep")) for k, v in p_np.items()}
    cfg = EPConfig(args.n_experts, 2, replica_slots=2, transport="padded")
    ep = functools.partial(ep_moe_ffn, mesh=mesh, cfg=cfg)
    (_, y), grads = jax.jit(jax.value_and_grad(_loss_fn(ep), argnums=(0, 1),
                                               has_aux=True))(x, p)
    _, _, stats = jax.jit(ep)(x, p)
    gather = functools.partial(multihost_utils.process_allgather, tiled=True)
    y = np.asarray(gather(y))
    grads = jax.tree.map(lambda g: np.asarray(gather(g)), grads)
    ref = functools.partial(layers.moe_ffn, top_k=2, renormalize=True)
    local = jax.local_devices()[0]
    x_l, p_l = jax.device_put((x_np, p_np), local)
    (_, y_ref), grads_ref = jax.jit(jax.value_and_grad(_loss_fn(ref), argnums=(0, 1),
                                                       has_aux=True))(x_l, p_l)
    errs = [float(np.max(np.abs(a - np.asarray(b))) / (np.max(np.abs(np.asarray(b))) + 1e-12))
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref))]
    load = np.asarray(gather(stats.device_load))
    return {"process_id": jax.process_index(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "local_devices": jax.local_device_count(),
            "y_max_err": float(np.max(np.abs(y - np.asarray(y_ref)))),
            "grad_max_rel_err": max(errs), "device_load": load.reshape(-1)[:8].tolist(),
            "replicas": int((np.asarray(stats.plan.slot_expert) >= 0).sum())}


def main(argv=None) -> None:
    parser = distributed.parser(__doc__.splitlines()[0], detect_cluster=False)
    parser.add_argument("--n_tokens", type=int, default=64)
    parser.add_argument("--n_experts", type=int, default=16)
    distributed.run(parser.parse_args(argv), run_check)


if __name__ == "__main__":
    main()
