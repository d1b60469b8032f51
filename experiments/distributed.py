"""What the multi-process checks share: their command-line flags and the
`jax.distributed` start-up / shutdown around one check (gloo collectives on CPU hosts)."""
from __future__ import annotations

import argparse
import json

import jax


def parser(description: str, *, detect_cluster: bool) -> argparse.ArgumentParser:
    """--process_id / --num_processes / --coordinator / --out / --seed. detect_cluster:
    --process_id may be omitted, and jax.distributed.initialize() then finds the cluster
    (Cloud TPU, SLURM, Open MPI); otherwise it is required."""
    p = argparse.ArgumentParser(description=description)
    if detect_cluster:
        p.add_argument("--process_id", type=int, default=None,
                       help="this process's id; omit to let jax.distributed.initialize() "
                            "detect the cluster (Cloud TPU, SLURM, Open MPI)")
    else:
        p.add_argument("--process_id", type=int, required=True)
    p.add_argument("--num_processes", type=int, default=2)
    p.add_argument("--coordinator", default="localhost:12355")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    return p


def run(args, check) -> None:
    """Join the cluster, run `check(args)`, leave it, write its report to args.out."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts only
    jax.config.update("jax_default_matmul_precision", "highest")
    if args.process_id is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id)
    try:
        report = check(args)
    finally:
        jax.distributed.shutdown()
    with open(args.out, "w") as f:
        json.dump(report, f)
