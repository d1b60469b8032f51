"""What the tiled matmul kernels (grouped_matmul, quant_matmul) share: validated tile sizes
and rounding a dimension up to whole tiles. Each kernel subclasses `TileSizes` with its
own defaults."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TileSizes:
    """Tile sizes: rows (bm), contraction (bk), output columns (bn); each >= 1."""

    bm: int = 128
    bk: int = 128
    bn: int = 128

    def __post_init__(self):
        for name in ("bm", "bk", "bn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
