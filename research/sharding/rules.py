"""Logical-axis sharding rules (MaxText / flax `nn.logical_axis_rules` style).

Every array of a model is described by *logical* axis names ("batch", "heads", "ffn",
...); a rule table maps each logical name onto zero, one or several *mesh* axes. The
default mesh has three axes:

    data    data parallelism: the batch, activations, the KV cache's rows / block pool
    tensor  tensor parallelism (Megatron): attention heads, FFN columns, the vocabulary
    expert  expert parallelism: MoE expert weights (MegaFlux's EP layer runs on this axis);
            for everything that is not an expert the expert axis is one more data axis

so one 8-device mesh can be (8, 1, 1) data-parallel, (2, 4, 1), (1, 1, 8), ...

A logical axis whose mesh axes do not divide it is an error that names the array, the
axis, the sizes and what would divide it; nothing is silently replicated. Head axes are
checked in *heads*, not in flattened columns: wq's 576 columns of SmolLM2 divide by 8,
its 9 heads do not, and a head cut in two would make attention communicate.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA, TENSOR, EXPERT = "data", "tensor", "expert"
MESH_AXES = (DATA, TENSOR, EXPERT)

# (logical axis, mesh axis | tuple of mesh axes | None). Unlisted logical axes replicate.
DEFAULT_RULES: tuple = (
    ("batch", (DATA, EXPERT)),     # activations, token batches, cache rows
    ("blocks", (DATA, EXPERT)),    # a paged cache's block pool (each data shard owns a range)
    ("heads", TENSOR),             # query heads (wq columns, wo rows)
    ("kv_heads", TENSOR),          # KV heads (wk/wv columns, the cache's head axis)
    ("ffn", TENSOR),               # dense FFN columns (w_gate/w_up columns, w_down rows)
    ("vocab", TENSOR),             # embedding rows / LM head columns
    ("experts", EXPERT),           # MoE expert weights
    ("embed", None), ("expert_ffn", None), ("length", None), ("head_dim", None),
    ("record", None), ("router", None),
)


def rules_dict(rules: Sequence) -> dict[str, tuple[str, ...]]:
    """{logical: tuple of mesh axes} from a rule list; a logical axis listed twice is an
    error (flax would silently take the first)."""
    out = {}
    for entry in rules:
        if len(entry) != 2:
            raise ValueError(f"a sharding rule is a (logical, mesh axes) pair, got {entry!r}")
        logical, mesh_axes = entry
        if logical in out:
            raise ValueError(f"logical axis {logical!r} appears twice in the rules")
        if mesh_axes is None:
            mesh_axes = ()
        elif isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        out[logical] = tuple(mesh_axes)
    return out


def make_mesh(data: int = 1, tensor: int = 1, expert: int = 1,
              devices: Sequence | None = None) -> Mesh:
    """A (data, tensor, expert) mesh over the first data*tensor*expert devices (all
    processes' devices under jax.distributed), built by `jax.make_mesh`: on TPU the
    device order follows the physical topology (rings and tori), on GPU device ids, on
    CPU jax.devices() order. A shape it cannot lay onto the TPU topology (a subset of a
    slice that is no sub-torus, several slices) keeps jax.devices() order.

    Axis types are Auto, stated: arrays are placed by the rules' NamedShardings and jit
    propagates the rest. Explicit axes (sharding in types, make_mesh's default) make every
    op whose output sharding is ambiguous name it: the forward's first op, the embedding
    gather from a vocab-split table, raises ShardingTypeError without an out_sharding."""
    for name, n in (("data", data), ("tensor", tensor), ("expert", expert)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = data * tensor * expert
    if need > len(devices):
        raise ValueError(f"mesh data={data} x tensor={tensor} x expert={expert} needs {need} "
                         f"devices, only {len(devices)} available")
    shape, types = (int(data), int(tensor), int(expert)), (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices[:need])
    except (ValueError, NotImplementedError, AssertionError):  # no topology-aware layout
        return Mesh(np.array(devices[:need]).reshape(shape), MESH_AXES, axis_types=types)


def mesh_axes_size(mesh: Mesh, mesh_axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in mesh_axes)


def logical_spec(logical_axes: Sequence[str | None], rules: Sequence, mesh: Mesh, *,
                 shape: Sequence[int] | None = None,
                 units: Mapping[str, int] | None = None, what: str = "array") -> P:
    """PartitionSpec of an array whose dims have these logical names.

    shape: the array's shape, to check divisibility; units: per logical axis the number
      of indivisible units (e.g. {"heads": 9} for wq's 576 columns), checked instead of
      the dim size. Mesh axes of size 1 are dropped from the spec. A mesh axis used by
      two dims of one array, a mesh axis the mesh lacks, or a dim its mesh axes do not
      divide raises ValueError naming `what`."""
    table = rules_dict(rules)
    units = dict(units or {})
    spec, used = [], set()
    for i, logical in enumerate(logical_axes):
        axes = tuple(a for a in table.get(logical, ()) if logical is not None)
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(f"rule maps logical axis {logical!r} to mesh axis {a!r}, "
                                 f"but the mesh has axes {tuple(mesh.axis_names)}")
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        if not axes:
            spec.append(None)
            continue
        clash = used.intersection(axes)
        if clash:
            raise ValueError(f"{what}: mesh axis {sorted(clash)} would shard two dims "
                             f"(logical axes {tuple(logical_axes)})")
        used.update(axes)
        n = mesh_axes_size(mesh, axes)
        if shape is not None:
            size = units.get(logical, shape[i])
            if size % n:
                divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
                raise ValueError(
                    f"cannot shard {what}: logical axis {logical!r} has {size} "
                    f"{'units' if logical in units else 'entries'} (dim {i} of shape "
                    f"{tuple(shape)}), not divisible by mesh axes {axes} of total size {n}. "
                    f"Pick a mesh whose {'x'.join(axes)} size divides {size} (divisors: "
                    f"{divisors}), or map {logical!r} to None in the rules to replicate it")
        spec.append(axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def named(mesh: Mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)


def override_rules(rules: Sequence = DEFAULT_RULES, **changes) -> tuple:
    """`rules` with some logical axes remapped, e.g. override_rules(vocab=None) for a
    vocabulary no tensor degree divides (a byte-level LM's 257)."""
    table = rules_dict(rules)
    unknown = set(changes) - set(table)
    if unknown:
        raise ValueError(f"override_rules: unknown logical axes {sorted(unknown)} "
                         f"(known: {sorted(table)})")
    return tuple((k, changes.get(k, v if v else None)) for k, v in table.items())


# A serving pool shared by every row (prefix cache, rows re-bound each pass): rows and
# blocks are not split, everything else as DEFAULT_RULES.
POOL_RULES = override_rules(DEFAULT_RULES, batch=None, blocks=None)


def check_pool_mesh(mesh: Mesh, rules: Sequence = POOL_RULES) -> None:
    """A shared paged pool splits over KV heads only: refuse rules that split rows or
    blocks, and a data axis > 1 (it would replicate every step's work)."""
    table = rules_dict(rules)
    split = [n for n in ("batch", "blocks")
             if any(mesh.shape.get(a, 1) > 1 for a in table.get(n, ()))]
    if split:
        raise ValueError(f"a shared paged pool cannot split {split} over the mesh (any row "
                         "may map any block): use POOL_RULES (batch=None, blocks=None)")
    if mesh.shape.get(DATA, 1) > 1:
        raise ValueError(f"mesh has data={mesh.shape[DATA]}: a serving pool is tensor / "
                         "expert parallel only; run one engine per data-parallel replica")
