"""Shared helpers of the speculative-decoding tests (imported by the test modules)."""
import jax
import numpy as np
from scipy import stats

from research.model import init_params, make_model, tiny_config


def chaotic_model(scale: float = 3.0, seed: int = 0, embed_scale: float = 1.0,
                  **overrides):
    """A random tiny model whose greedy output varies (the default init repeats one token,
    which any drafter guesses); scaling the matrices by 3 gives chaotic output.
    `embed_scale` scales the tied embedding/head (logit spread) on top of that."""
    config = tiny_config(**overrides)
    params = init_params(config, jax.random.key(seed))
    params = jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params)
    params["embed"] = params["embed"] * embed_scale
    return make_model(config, params)


def perturbed(model, noise: float, seed: int = 1):
    """The same model with multiplicative noise on its weights: a close draft model."""
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x * (1 + noise * jax.random.normal(k, x.shape)) if x.ndim >= 2 else x
              for x, k in zip(leaves, keys)]
    return model.replace(params=jax.tree.unflatten(tree, leaves))


def counts_chisquare_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of `counts` against `probs`; cells expected below
    `min_expected` are pooled into one (the test's asymptotics need it)."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    if np.any(counts[expected == 0] > 0):
        return 0.0  # an impossible outcome was observed
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)
