r"""A sharded forward and decode step under jax.distributed, checked against one process.

One process per host (here: CPU processes on localhost with gloo collectives, each with
`--local_devices` simulated devices); the (data, tensor) mesh spans every process's
devices. Every process builds the same small model from the seed, shards it with
`research.sharding.shard_model`, runs the jitted prefill and one decode step on global
arrays, gathers the logits, and compares them with the same model run unsharded on its
own first local device. Writes a JSON report to --out.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m \
        experiments.scaleout.distributed_check --process_id=0 --num_processes=2 \
        --coordinator=localhost:12355 --out=/tmp/p0.json   # and process_id=1 likewise

On a real cluster: one such process per host, no XLA_FLAGS; `--coordinator=<host0>:<port>`
with each host's `--process_id`, or, on Cloud TPU (and SLURM / Open MPI launches, which
`jax.distributed.initialize()` detects), no `--process_id` at all:

    python -m experiments.scaleout.distributed_check --out=/tmp/check.json --tensor=4
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments import distributed


def run_check(args) -> dict:
    from jax.experimental import multihost_utils

    from research.model import init_params, make_model, tiny_config
    from research.decode.generate import decode_step, prefill
    from research.sharding import make_mesh, per_device_bytes, shard_model

    n = jax.device_count()
    tensor = args.tensor
    mesh = make_mesh(data=n // tensor, tensor=tensor)
    config = tiny_config(vocab_size=128, dim=64, n_heads=8, n_kv_heads=4, head_dim=16,
                         ffn_dim=128)
    params = init_params(config, jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    batch, max_len = mesh.shape["data"] * 2, 32
    tokens = rng.integers(0, config.vocab_size, (batch, 16)).astype(np.int32)
    lengths = rng.integers(4, 17, batch).astype(np.int32)

    local = jax.local_devices()[0]
    with jax.default_device(local):
        ref = make_model(config, jax.device_put(params, local))
        states = ref.init_cache(batch, max_len)
        ref_logits, states = prefill(ref, tokens, lengths, states)
        nxt = np.asarray(jnp.argmax(ref_logits, -1)).astype(np.int32)
        ref_step, _ = decode_step(ref, nxt, lengths, np.ones(batch, bool), states)

    sharded = shard_model(make_model(config, params), mesh)
    s_states = sharded.init_cache(batch, max_len)
    logits, s_states = prefill(sharded, tokens, lengths, s_states)
    step, s_states = decode_step(sharded, nxt, lengths, np.ones(batch, bool), s_states)
    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))  # noqa: E731
    logits, step = gather(logits), gather(step)
    return {"process_id": jax.process_index(), "process_count": jax.process_count(),
            "device_count": n, "local_devices": jax.local_device_count(),
            "mesh": dict(mesh.shape),
            "prefill_max_err": float(np.max(np.abs(logits - np.asarray(ref_logits)))),
            "decode_max_err": float(np.max(np.abs(step - np.asarray(ref_step)))),
            "greedy_equal": bool((logits.argmax(-1) == np.asarray(ref_logits).argmax(-1)).all()
                                 and (step.argmax(-1) == np.asarray(ref_step).argmax(-1)).all()),
            "param_bytes_local_max": per_device_bytes(sharded.params)["max"],
            "param_bytes_total": per_device_bytes(ref.params)["total"]}


def main(argv=None) -> None:
    parser = distributed.parser(__doc__.splitlines()[0], detect_cluster=True)
    parser.add_argument("--tensor", type=int, default=4, help="tensor-parallel degree")
    distributed.run(parser.parse_args(argv), run_check)


if __name__ == "__main__":
    main()
