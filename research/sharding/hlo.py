"""What a compiled step communicates: the collectives in its optimised HLO.

    collectives(jax.jit(step).lower(*args).compile().as_text())
    -> [Collective(op="all-reduce", dtype="f32", shape=(2, 1, 576), nbytes=4608), ...]

The partitioned program is the ground truth for "nothing is gathered to one device per
step": an all-gather of a parameter or KV-cache array would show up here with that
array's shape (`gathers_of`).
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

import jax
import numpy as np

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
       "ragged-all-to-all")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
          "s64": 8, "f64": 8, "u64": 8}
# "%name = f32[2,1,64]{2,1,0} all-reduce(" or a tuple result "(f32[..], f32[..]) all-gather-start("
_LINE = re.compile(r"=\s*(?P<result>\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                   r"(?P<op>[a-z\-]+?)(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


class Collective(NamedTuple):
    op: str
    dtype: str
    shape: tuple
    nbytes: int


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of an HLO module (async start/done pairs counted once)."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if not m or m.group("op") not in OPS:
            continue
        arrays = _ARRAY.findall(m.group("result"))
        if m.group("result").startswith("(") and len(arrays) > 1:
            arrays = arrays[-1:]  # async start: (operand, result[, scratch]) -> the result
            # (an all-gather-start's last shape is its gathered output)
        for dtype, dims in arrays:
            shape = tuple(int(d) for d in dims.split(",") if d)
            out.append(Collective(m.group("op"), dtype, shape,
                                  math.prod(shape) * _BYTES.get(dtype, 4)))
    return out


def _squeeze(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def gathers_of(hlo_text: str, *trees) -> list[Collective]:
    """All-gathers (or all-to-alls) in the HLO whose result has the element count of a
    leaf of `trees` (params, KV cache states: global arrays or shape structs) with at
    least 2 dims: the signature of an array being assembled on a device."""
    sizes = {int(np.prod(x.shape)) for t in trees for x in jax.tree.leaves(t)
             if hasattr(x, "shape") and len(_squeeze(x.shape)) >= 2}
    return [c for c in collectives(hlo_text) if c.op in ("all-gather", "all-to-all")
            and math.prod(c.shape) in sizes]


def summary(hlo_text: str) -> dict:
    """{op: {"count": n, "bytes": total result bytes}} of the collectives in the HLO."""
    out = {}
    for c in collectives(hlo_text):
        s = out.setdefault(c.op, {"count": 0, "bytes": 0})
        s["count"] += 1
        s["bytes"] += c.nbytes
    return out
