"""Tile-visit schedules shared by the Pallas kernels and the tiled plain-JAX implementation.

Rows are cut into tiles of `bm` rows. A *visit* is one (segment, row tile) pair: the kernel
step that multiplies that tile by the segment's weights and writes (gmm) or accumulates
(tgmm) only the rows of the segment. Groups need not be tile-aligned, so a tile that holds a
group boundary is visited once per group it touches. The number of visits depends on the
data, but its bound is static: m_tiles + G (every extra segment adds at most one visit),
so the grids have a fixed size and the surplus visits are flagged invalid (no writes).

gmm segments are the G groups plus a *tail* (segment G: rows past sum(group_sizes)), so
every output row is written exactly once (tail rows with zeros). tgmm segments are the G
groups; an empty group gets one visit that writes its zero output block.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Int


class Visits(NamedTuple):
    segment: Int[Array, "V"]  # group id (G = tail for gmm)
    tile: Int[Array, "V"]  # row tile index
    valid: Int[Array, "V"]  # 1 for real visits, 0 for the static-size padding
    first: Int[Array, "V"]  # 1 on the first visit of a segment (tgmm: zero the accumulator)
    last: Int[Array, "V"]  # 1 on the last visit of a segment (tgmm: write the output)
    starts: Int[Array, "S"]  # first row of each segment
    ends: Int[Array, "S"]  # one past the last row of each segment


def num_visits(m_tiles: int, n_groups: int) -> int:
    return m_tiles + n_groups


def _segment_bounds(group_sizes: Int[Array, "G"], m_rows: int, m_padded: int,
                    with_tail: bool):
    # Rows past m_rows belong to no group, as in jax.lax.ragged_dot.
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m_rows)
    starts = jnp.minimum(ends - sizes, m_rows)
    if with_tail:
        starts = jnp.append(starts, ends[-1])
        ends = jnp.append(ends, jnp.int32(m_padded))
    return starts, ends


def _visits(starts, ends, m_tiles: int, bm: int, n_visits: int, min_one: bool) -> Visits:
    nonempty = ends > starts
    first_tile = jnp.minimum(starts // bm, m_tiles - 1)
    last_tile = jnp.where(nonempty, (ends - 1) // bm, first_tile)
    count = jnp.where(nonempty, last_tile - first_tile + 1, 1 if min_one else 0)
    inclusive = jnp.cumsum(count)
    v = jnp.arange(n_visits, dtype=jnp.int32)
    n_segments = starts.shape[0]
    seg = jnp.minimum(jnp.searchsorted(inclusive, v, side="right"), n_segments - 1)
    valid = v < inclusive[-1]
    last_valid = jnp.maximum(inclusive[-1] - 1, 0)
    seg_last = jnp.minimum(jnp.searchsorted(inclusive, last_valid, side="right"),
                           n_segments - 1)
    seg = jnp.where(valid, seg, seg_last).astype(jnp.int32)
    local = v - (inclusive - count)[seg]
    tile = jnp.where(valid, first_tile[seg] + local, last_tile[seg_last])
    prev_seg = jnp.concatenate([jnp.full((1,), -1, jnp.int32), seg[:-1]])
    next_seg = jnp.concatenate([seg[1:], jnp.full((1,), -1, jnp.int32)])
    return Visits(segment=seg, tile=tile.astype(jnp.int32), valid=valid.astype(jnp.int32),
                  first=(seg != prev_seg).astype(jnp.int32),
                  last=(seg != next_seg).astype(jnp.int32),
                  starts=starts.astype(jnp.int32), ends=ends.astype(jnp.int32))


def gmm_visits(group_sizes: Int[Array, "G"], m_rows: int, m_padded: int, bm: int) -> Visits:
    """Visits for gmm over m_padded rows: every row tile of every segment incl. the tail."""
    m_tiles = m_padded // bm
    starts, ends = _segment_bounds(group_sizes, m_rows, m_padded, with_tail=True)
    return _visits(starts, ends, m_tiles, bm, num_visits(m_tiles, group_sizes.shape[0]),
                   min_one=False)


def tgmm_visits(group_sizes: Int[Array, "G"], m_rows: int, m_padded: int,
                bm: int) -> Visits:
    """Visits for tgmm: every row tile of every group; one (empty) visit per empty group."""
    m_tiles = m_padded // bm
    starts, ends = _segment_bounds(group_sizes, m_rows, m_padded, with_tail=False)
    return _visits(starts, ends, m_tiles, bm, num_visits(m_tiles, group_sizes.shape[0]),
                   min_one=True)


def row_mask(visits: Visits, v, bm: int) -> Array:
    """[bm] bool: rows of visit v's tile that belong to its segment (and v is valid)."""
    seg = visits.segment[v]
    rows = visits.tile[v] * bm + jnp.arange(bm, dtype=jnp.int32)
    inside = (rows >= visits.starts[seg]) & (rows < visits.ends[seg])
    return inside & (visits.valid[v] > 0)
