"""Exact speculative sampling: the emitted token is distributed as the target's p."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.specdecode.specdecode_helpers import counts_chisquare_pvalue
from research.specdecode import verify as verify_mod
from research.specdecode.verify import residual_distribution

# jitted: eager op-by-op dispatch of the many small ops is far slower than one compile
verify_drafts = jax.jit(verify_mod.verify_drafts, static_argnames="greedy")


def _first_token_samples(p, q, n, seed, one_hot_draft=False):
    """Draft d ~ q (or a fixed token), verify with K=1; return the first emitted token."""
    v = p.shape[0]
    k_draft, k_verify = jax.random.split(jax.random.key(seed))
    if one_hot_draft:
        d = jnp.full((n,), int(jnp.argmax(q)), jnp.int32)
        draft_probs = None
    else:
        d = jax.random.categorical(k_draft, jnp.log(q), shape=(n,)).astype(jnp.int32)
        draft_probs = jnp.broadcast_to(q, (n, 1, v))
    p_next = jax.nn.softmax(jax.random.normal(jax.random.key(seed + 1), (n, v)))  # bonus dist
    target = jnp.stack([jnp.broadcast_to(p, (n, v)), p_next], axis=1)
    verdict = verify_drafts(target, d[:, None], draft_probs, jnp.ones((n,), jnp.int32),
                            k_verify, greedy=False)
    first = jnp.where(verdict.n_accepted >= 1, d, verdict.next_token)
    return np.asarray(first), np.asarray(verdict.n_accepted)


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_first_token_has_target_distribution(one_hot_draft):
    v, n = 7, 100_000
    p = jax.nn.softmax(jax.random.normal(jax.random.key(0), (v,)))
    q = jax.nn.softmax(2 * jax.random.normal(jax.random.key(1), (v,)))
    first, n_acc = _first_token_samples(p, q, n, seed=2, one_hot_draft=one_hot_draft)
    counts = np.bincount(first, minlength=v)
    assert counts_chisquare_pvalue(counts, p) > 1e-3
    # acceptance probability is sum_x min(p, q) (one-hot q: p(d))
    expected = float(p[jnp.argmax(q)]) if one_hot_draft else float(jnp.minimum(p, q).sum())
    assert abs(n_acc.mean() - expected) < 5 * np.sqrt(expected * (1 - expected) / n)
    # power check: the draft's own distribution is clearly rejected by the same test
    if not one_hot_draft:
        counts_q = np.bincount(np.asarray(jax.random.categorical(
            jax.random.key(9), jnp.log(q), shape=(n,))), minlength=v)
        assert counts_chisquare_pvalue(counts_q, p) < 1e-6


def test_greedy_accepts_exactly_the_argmax_prefix():
    v = 11
    logits = jax.random.normal(jax.random.key(0), (3, 4, v))
    target = jax.nn.one_hot(jnp.argmax(logits, -1), v)
    argmax = np.asarray(jnp.argmax(logits, -1))
    drafts = argmax[:, :3].copy()
    drafts[0, 1] = (drafts[0, 1] + 1) % v  # row 0 diverges at draft 2
    drafts[1, 0] = (drafts[1, 0] + 1) % v  # row 1 at draft 1; row 2 all accepted
    n_drafted = jnp.array([3, 3, 2])
    verdict = verify_drafts(target, jnp.asarray(drafts), None, n_drafted, jax.random.key(1),
                            greedy=True)
    assert verdict.n_accepted.tolist() == [1, 0, 2]
    # the next token is the argmax where the draft diverged / after the last draft
    assert verdict.next_token.tolist() == [argmax[0, 1], argmax[1, 0], argmax[2, 2]]


def test_padding_drafts_never_accepted_and_k0():
    v = 5
    target = jax.nn.one_hot(jnp.zeros((2, 3), jnp.int32), v)
    drafts = jnp.zeros((2, 2), jnp.int32)  # would all be accepted if real
    verdict = verify_drafts(target, drafts, None, jnp.array([0, 1]), jax.random.key(0),
                            greedy=True)
    assert verdict.n_accepted.tolist() == [0, 1]
    verdict = verify_drafts(target[:, :1], drafts[:, :0], None, jnp.array([0, 0]),
                            jax.random.key(0), greedy=False)
    assert verdict.n_accepted.tolist() == [0, 0] and verdict.next_token.tolist() == [0, 0]


def test_residual_distribution():
    p = jnp.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    q = jnp.array([[0.6, 0.1, 0.3], [0.2, 0.3, 0.5]])
    r = residual_distribution(p, q)
    np.testing.assert_allclose(r[0], [0.0, 1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(r[1], p[1])  # empty residual: falls back to p


def test_shape_errors_name_the_argument():
    target = jnp.ones((2, 3, 5)) / 5
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_mod.verify_drafts(target, jnp.zeros((2, 3), jnp.int32), None, jnp.ones(2, jnp.int32),
                      jax.random.key(0), greedy=False)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_mod.verify_drafts(target, jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2, 4)),
                      jnp.ones(2, jnp.int32), jax.random.key(0), greedy=False)
