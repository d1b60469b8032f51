"""KV rollback of rejected draft tokens through the cache interface.

Verification writes the pending token and all k drafted tokens into every layer's cache;
rejected ones are rolled back by *not advancing the row's length*: the next chunk starts
at the old length + accepted, so its writes overwrite the rejected slots, and until then
attention never reads them because a dense layout only attends to positions below
`start + n_new` (DenseKVCache masks `kv_pos >= start + n_new`).

A ring buffer (WindowKVCache) differs twice. It attends to its stored entries *before*
writing the new chunk and trusts every stored position, so stale entries at positions
>= start must be invalidated (`truncate_states`, a no-op for other layouts); and writing
position p overwrites position p - ring, which a later query may still need, so the ring
gets `max_draft` spare slots (`with_rollback_slack`). Rather than trusting a list of
types, `check_rollback` runs each cache's own `update_and_attend` on random K/V with and
without a rejected speculative chunk in between and requires identical outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from research.kv.window import WindowKVCache
from research.model.llama import Model


def with_rollback_slack(model: Model, max_draft: int) -> Model:
    """`model` with every `WindowKVCache` ring widened by `max_draft` slots (same window).

    Dense-style caches need nothing. Attention is unchanged (it still uses the layer's
    window); only `max_draft` extra slots per ring are stored.
    """
    if max_draft < 0:
        raise ValueError(f"max_draft must be >= 0, got {max_draft}")
    caches = []
    for i, cache in enumerate(model.caches):
        window = model.config.window(i)
        if isinstance(cache, WindowKVCache) and window is not None and \
                cache.window < window + max_draft:
            cache = WindowKVCache(window=window + max_draft, codec=cache.codec)
        caches.append(cache)
    return model.replace(caches=tuple(caches))


def truncate_state(cache, state, lengths):
    """Forget a layer's entries at positions >= lengths[b] (stale speculative tokens)."""
    return cache.truncate(state, lengths)  # position-addressed layouts: as it is (probed)


def truncate_states(model: Model, states: tuple, lengths) -> tuple:
    """`truncate_state` for every layer of `model`."""
    return tuple(truncate_state(c, s, lengths) for c, s in zip(model.caches, states))


@functools.partial(jax.jit, static_argnames=("p", "accepted", "window"))
def _attend_after(cache, state, q, k, v, junk, p, accepted, window):
    """Query at p + accepted after the real tokens before it (and, with `junk`, after a
    speculative chunk at p whose first `accepted` tokens are real and the rest rejected)."""
    b = q.shape[0]
    s = p + accepted

    def run(state, start, q, k, v):
        return cache.update_and_attend(
            state, q, k, v, start=jnp.full((b,), start, jnp.int32),
            n_new=jnp.full((b,), q.shape[1], jnp.int32), window=window)

    if junk is None:
        _, state = run(state, 0, q[:, :s], k[:, :s], v[:, :s])
    else:
        _, state = run(state, 0, q[:, :p], k[:, :p], v[:, :p])
        jq, jk, jv = junk
        t = jq.shape[1]
        real = jnp.arange(t)[None, :, None, None] < accepted
        jk = jnp.where(real, k[:, p:p + t], jk)
        jv = jnp.where(real, v[:, p:p + t], jv)
        _, state = run(state, p, jq, jk, jv)
        state = truncate_state(cache, state, jnp.full((b,), s, jnp.int32))
    out, _ = run(state, s, q[:, s:s + 1], k[:, s:s + 1], v[:, s:s + 1])
    return out


def check_rollback(model: Model, max_draft: int, *, atol: float = 1e-5) -> None:
    """Raise ValueError if some layer's cache cannot discard `max_draft + 1` rejected tokens.

    Per distinct cache object: write a random prefix, then a chunk of max_draft + 1
    tokens of which only the first `a` are real, roll back to prefix + a
    (`truncate_state`), then query there; the attention
    output must equal the one without the speculative chunk, for a = 0 and a = max_draft.
    """
    c = model.config
    t = max_draft + 1
    checked = {}
    for layer, cache in enumerate(model.caches):
        window = c.window(layer)
        sig = (type(cache), cache, window)
        try:
            if sig in checked:
                continue
        except TypeError:  # unhashable cache (array leaves): check every layer
            pass
        p = (window or 0) + 2 * t + 3  # long enough for a ring to wrap
        max_len = p + 2 * t + 2
        keys = jax.random.split(jax.random.key(layer), 6)
        shape_q, shape_kv = (1, max_len, c.n_heads, c.head_dim), (1, max_len, c.n_kv_heads,
                                                                    c.head_dim)
        q, k, v = (jax.random.normal(keys[0], shape_q), jax.random.normal(keys[1], shape_kv),
                   jax.random.normal(keys[2], shape_kv))
        junk = (jax.random.normal(keys[3], (1, t, c.n_heads, c.head_dim)),
                jax.random.normal(keys[4], (1, t, c.n_kv_heads, c.head_dim)) * 3,
                jax.random.normal(keys[5], (1, t, c.n_kv_heads, c.head_dim)) * 3)
        state = cache.init(1, max_len, c.n_kv_heads, c.head_dim)
        for accepted in (0, max_draft):
            clean = _attend_after(cache, state, q, k, v, None, p=p, accepted=accepted,
                                  window=window)
            spec = _attend_after(cache, state, q, k, v, junk, p=p, accepted=accepted,
                                 window=window)
            err = float(jnp.max(jnp.abs(clean.astype(jnp.float32) - spec.astype(jnp.float32))))
            if not np.isfinite(err) or err > atol:
                hint = (" (a ring buffer: use specdecode.with_rollback_slack(model, "
                        f"{max_draft}))" if isinstance(cache, WindowKVCache) else "")
                raise ValueError(
                    f"layer {layer}'s cache {cache.describe()} cannot roll back rejected "
                    f"draft tokens: attention after a rejected chunk of {t} differs by "
                    f"{err:.3g}{hint}")
        try:
            checked[sig] = True
        except TypeError:
            pass


_CHECKED: set = set()


def check_rollback_cached(model: Model, max_draft: int) -> None:
    """`check_rollback`, once per (config, caches, max_draft) when the caches are hashable."""
    try:
        sig = (model.config, model.caches, max_draft)
        hash(sig)
    except TypeError:  # caches with array leaves (e.g. calibrated codebooks): every time
        check_rollback(model, max_draft)
        return
    if sig not in _CHECKED:
        check_rollback(model, max_draft)
        _CHECKED.add(sig)
