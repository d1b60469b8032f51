"""Weighted k-means (Lloyd) in JAX, batched over independent problems.

Used for every VQ codebook: TaSQ's weighted distortion is plain L2 in the folded
(query-weighted) coordinates, and `dim_weights` gives the same objective without folding:
    min sum_n w_n * sum_c a_c (x_nc - c_kc)^2.
Initialisation is k-means++ (D^2 sampling); empty clusters are re-seeded on the points
currently worst served, so every centroid stays in use.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from research.tasq.vq import nearest


def _sq_dist(x: Float[Array, "N g"], c: Float[Array, "K g"], a: Float[Array, "g"]) -> Array:
    """Weighted squared distances [K, N] (centroids first: XLA:CPU reduces over the leading
    axis of this layout ~3x faster than over a trailing K axis), clipped at 0."""
    xa, ca = x * a, c * a
    d = jnp.sum(c * ca, -1)[:, None] - 2 * ca @ x.T + jnp.sum(x * xa, -1)[None, :]
    return jnp.maximum(d, 0.0)


def _kmeans_pp(key, x, w, a, k):
    n = x.shape[0]
    first = jax.random.choice(key, n, p=w / jnp.sum(w))
    cents = jnp.zeros((k, x.shape[1]), x.dtype).at[0].set(x[first])
    best = _sq_dist(x, cents[:1], a)[0]

    def step(i, carry):
        cents, best, key = carry
        key, sub = jax.random.split(key)
        p = w * best
        p = jnp.where(jnp.sum(p) > 0, p / jnp.maximum(jnp.sum(p), 1e-30), w / jnp.sum(w))
        idx = jax.random.choice(sub, n, p=p)
        cents = cents.at[i].set(x[idx])
        best = jnp.minimum(best, _sq_dist(x, x[idx][None], a)[0])
        return cents, best, key

    cents, _, _ = jax.lax.fori_loop(1, k, step, (cents, best, key))
    return cents


def _lloyd_step(x, w, a, cents):
    k = cents.shape[0]
    assign, dmin = nearest(_sq_dist(x, cents, a))
    mass = jax.ops.segment_sum(w, assign, num_segments=k)
    sums = jax.ops.segment_sum(x * w[:, None], assign, num_segments=k)
    new = sums / jnp.maximum(mass, 1e-30)[:, None]
    # Re-seed empty clusters on the worst-served points (largest weighted error). With
    # fewer points than centroids (tiny calibration sets) the spare centroids duplicate
    # points: harmless, every point is still encoded exactly.
    n_seed = min(k, x.shape[0])
    worst = jax.lax.top_k(w * dmin, n_seed)[1]
    empty = mass <= 0
    slot = jnp.cumsum(empty) - 1
    reseed = x[worst[jnp.clip(slot, 0, n_seed - 1)]]
    return jnp.where(empty[:, None], reseed, new)


def _kmeans_one(key, x, w, a, k: int, iters: int):
    cents = _kmeans_pp(key, x, w, a, k)
    return jax.lax.fori_loop(0, iters, lambda i, c: _lloyd_step(x, w, a, c), cents)


@functools.partial(jax.jit, static_argnames=("k", "iters"))
def _kmeans_many(keys, x, w, a, k: int, iters: int):
    # lax.map, not vmap: XLA:CPU runs the per-problem [N, g] x [g, K] dots much faster
    # than one batched dot with a tiny contraction.
    return jax.lax.map(lambda args: _kmeans_one(*args, k, iters), (keys, x, w, a))


def kmeans(x: Float[Array, "P N g"], k: int, *, iters: int = 20, key: jax.Array,
           weights: Float[Array, "P N"] | None = None,
           dim_weights: Float[Array, "P g"] | None = None) -> Float[Array, "P K g"]:
    """Independent weighted k-means for each of P problems; returns f32 centroids."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim != 3:
        raise ValueError(f"x must be [problems, points, dims], got {x.shape=}")
    p, n, g = x.shape
    if n == 0:
        raise ValueError("k-means needs at least one point per problem (got 0)")
    if not 1 <= k:
        raise ValueError(f"k must be >= 1, got {k}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    if not bool(jnp.all(jnp.isfinite(x))):
        raise ValueError("k-means data contains NaN or inf")
    w = jnp.ones((p, n), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    a = jnp.ones((p, g), jnp.float32) if dim_weights is None else jnp.asarray(dim_weights,
                                                                              jnp.float32)
    if w.shape != (p, n) or a.shape != (p, g):
        raise ValueError(f"weights must be [{p}, {n}] and dim_weights [{p}, {g}], got "
                         f"{w.shape=} {a.shape=}")
    if bool(jnp.any(w < 0)) or bool(jnp.any(a < 0)) or bool(jnp.any(jnp.sum(w, -1) <= 0)):
        raise ValueError("weights and dim_weights must be >= 0 with a positive total")
    keys = jax.random.split(key, p)
    if k > 256:
        raise ValueError(f"k must be <= 256 (uint8 codes), got {k}")
    return _kmeans_many(keys, x, w, a, k, iters)


def distortion(x: Float[Array, "P N g"], cents: Float[Array, "P K g"]) -> Array:
    """Mean squared error [P] of encoding x with its nearest centroid."""
    ones = jnp.ones(x.shape[-1], jnp.float32)
    return jax.lax.map(lambda xc: jnp.mean(jnp.min(_sq_dist(xc[0], xc[1], ones), 0)),
                       (x, cents))
