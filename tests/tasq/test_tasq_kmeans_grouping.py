"""Weighted k-means and covariance-aware grouping."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.tasq.grouping import (channel_units, covariance_grouping, group_cost,
                                    rope_pair_units)
from research.tasq.kmeans import distortion, kmeans


def test_kmeans_recovers_separated_clusters():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(2, 8, 3)) * 10
    labels = rng.integers(0, 8, (2, 400))
    x = centers[np.arange(2)[:, None], labels] + 0.01 * rng.normal(size=(2, 400, 3))
    cents = kmeans(x, 8, iters=10, key=jax.random.key(0))
    # every true centre has a learnt centroid next to it
    d = np.linalg.norm(np.asarray(cents)[:, :, None] - centers[:, None], axis=-1)
    assert d.min(axis=1).max() < 0.1
    assert float(distortion(jnp.asarray(x), cents).max()) < 1e-3


def test_kmeans_with_fewer_points_than_centroids_encodes_every_point_exactly():
    x = np.random.default_rng(1).normal(size=(2, 20, 8))  # 20 points, 256 centroids
    cents = kmeans(x, 256, iters=3, key=jax.random.key(0))
    assert cents.shape == (2, 256, 8) and bool(jnp.all(jnp.isfinite(cents)))
    assert float(distortion(jnp.asarray(x), cents).max()) < 1e-5  # f32 rounding only


def test_kmeans_point_and_dim_weights():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 500, 2))
    w = np.zeros((1, 500))
    w[0, :10] = 1.0  # only 10 points count, and k = 10: each gets its own centroid
    cents = np.asarray(kmeans(x, 10, iters=10, key=jax.random.key(1), weights=w))
    d = np.linalg.norm(x[0, :10, None] - cents[0][None], axis=-1).min(-1)
    assert d.max() < 1e-5
    # a dimension of weight 0 is ignored: centroids only resolve the weighted dimension
    x2 = np.stack([rng.normal(size=500), 100 * rng.normal(size=500)], -1)[None]
    c2 = np.asarray(kmeans(x2, 4, iters=15, key=jax.random.key(2),
                           dim_weights=np.array([[1.0, 0.0]])))
    assert np.ptp(c2[0, :, 0]) > 1.0


def test_kmeans_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        kmeans(np.full((1, 10, 2), np.nan), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="at least one point"):
        kmeans(np.zeros((1, 0, 2)), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="256"):
        kmeans(np.zeros((1, 300, 2)), 300, key=jax.random.key(0))


def _block_cov(rng, d, blocks):
    """Covariance with strongly correlated channel blocks (given as index lists)."""
    cov = np.diag(rng.uniform(0.5, 2.0, d))
    for b in blocks:
        v = rng.normal(size=d) * 0
        v[b] = rng.uniform(1, 3, len(b))
        cov += 20 * np.outer(v, v)
    return cov


def test_grouping_puts_correlated_channels_together():
    rng = np.random.default_rng(2)
    d = 16
    blocks = [[0, 5, 9, 14], [1, 2, 11, 12]]
    cov = _block_cov(rng, d, blocks)
    perm = covariance_grouping(cov, 4, channel_units(d))
    groups = [set(perm[i:i + 4]) for i in range(0, d, 4)]
    assert sorted(perm) == list(range(d))
    for b in blocks:
        assert set(b) in groups
    natural = [list(range(i, i + 4)) for i in range(0, d, 4)]
    assert group_cost(cov, [sorted(g) for g in groups]) < group_cost(cov, natural)


def test_grouping_keeps_rope_pairs_together():
    rng = np.random.default_rng(3)
    d = 16
    a = rng.normal(size=(d, d))
    perm = covariance_grouping(a @ a.T, 4, rope_pair_units(d))
    for i in range(0, d, 4):
        g = set(perm[i:i + 4])
        assert all((c + d // 2) % d in g for c in g)


def test_grouping_bad_sizes():
    with pytest.raises(ValueError, match="group_size"):
        covariance_grouping(np.eye(16), 3, rope_pair_units(16))
    with pytest.raises(ValueError, match="group_size"):
        covariance_grouping(np.eye(16), 5, channel_units(16))


def test_grouping_with_a_single_group_is_the_sorted_channels():
    """group_size == head_dim (1 bit/channel at head_dim 8): one group, nothing to swap."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8))
    perm = covariance_grouping(np.cov(x, rowvar=False), 8, rope_pair_units(8))
    np.testing.assert_array_equal(perm, np.arange(8))
