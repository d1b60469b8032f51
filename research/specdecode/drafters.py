"""Drafters: cheap guesses of the next k tokens that the target model then verifies.

A drafter is a NamedTuple of pure functions (like a `Transform`), so `speculative_generate`
runs any of them inside one jitted `lax.while_loop`:

    state = drafter.init(target, batch, max_len, max_draft)  # host side, before jit
    state = drafter.prefill(state, target, tokens, lengths)  # after the target's prefill
    avail = drafter.available(state, ctx, k_max)             # tokens it could draft now
    draft, state, caches = drafter.propose(state, target, caches, ctx, k, sampling, key)
    state = drafter.observe(state, target, caches, ctx)      # a step that drafted nothing

`ctx.history[b, :ctx.n_history[b]]` is row b's prompt plus everything generated; its last
token is *pending*: sampled but not yet in the target's KV cache (the verify pass feeds it
first). `propose` may write scratch K/V into the target's caches at positions
>= n_history - 1 (the loop rolls them back before verifying, see `rollback`), which is
how the self-speculative drafter shares the target's caches for its layers; the caches it
receives are already rolled back to n_history - 1.

`Draft.probs` is the distribution each drafted token was sampled from (needed for exact
rejection sampling); None means the drafter is deterministic (q is one-hot on the token).
`Availability.bucket` is a confidence class (prompt lookup: the matched n-gram size); the
adaptive policy learns an acceptance rate per class, because a 3-gram match is accepted
far more often than a 1-gram one.

Three drafters: `prompt_lookup` (n-gram match in the context, no model), `self_speculative`
(the target's own first layers or a layer subset, with its shared head), `model_drafter`
(a separate small model with the same vocabulary, with its own caches).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from research.model.llama import Model, forward
from research.decode.sampling import SamplingConfig, sample, token_probs
from research.specdecode import layers as layer_subset
from research.specdecode import rollback


class DraftContext(NamedTuple):
    history: Int[Array, "B S"]  # prompt + generated tokens, right-padded
    n_history: Int[Array, "B"]  # valid tokens per row; history[b, n-1] is pending
    active: Array  # [B] bool: rows still generating


class Availability(NamedTuple):
    n: Int[Array, "B"]  # tokens the drafter can propose now (0: none)
    bucket: Int[Array, "B"]  # confidence class in [0, Drafter.n_buckets)


class Draft(NamedTuple):
    tokens: Int[Array, "B K"]  # drafted ids; entries >= n[b] are padding
    n: Int[Array, "B"]  # how many drafted tokens of row b are real (<= K)
    probs: Float[Array, "B K V"] | None  # draft distribution q; None = deterministic


class Drafter(NamedTuple):
    name: str
    init: Callable[[Model, int, int, int], Any]
    prefill: Callable[[Any, Model, Array, Array], Any]
    available: Callable[[Any, DraftContext, int], Availability]
    propose: Callable[..., tuple[Draft, Any, tuple]]
    observe: Callable[[Any, Model, tuple, DraftContext], Any]
    # True when `propose` costs target-model compute per drafted token (the adaptive
    # policy then also weighs drafting cost); False for free drafters like prompt lookup.
    uses_model: bool = False
    n_buckets: int = 1  # confidence classes `available` may report


def _no_state(target, batch, max_len, max_draft):
    del target, batch, max_len, max_draft
    return ()


def _keep_state(state, *args):
    del args
    return state


# ----------------------------------------------------------------------------- prompt lookup
def ngram_match(history: Int[Array, "B S"], n_history: Int[Array, "B"],
                ngram: int) -> tuple[Array, Array]:
    """Most recent earlier occurrence of each row's last `ngram` tokens.

    Returns (found [B] bool, cont [B] int): history[cont - ngram : cont] equals the row's
    suffix, cont < n_history (at least one known token follows the match), and cont is
    the largest such position (the latest occurrence: the one an edit is copying).
    """
    s = history.shape[1]
    if ngram < 1 or ngram >= s:
        raise ValueError(f"ngram must be in [1, {s}), got {ngram}")
    idx = jnp.clip(n_history[:, None] - ngram + jnp.arange(ngram)[None, :], 0, s - 1)
    suffix = jnp.take_along_axis(history, idx, axis=1)  # [B, n]
    n_starts = s - ngram + 1
    eq = jnp.ones((history.shape[0], n_starts), bool)
    for i in range(ngram):  # window j matches when history[j + i] == suffix[i] for all i
        eq &= history[:, i:i + n_starts] == suffix[:, i:i + 1]
    starts = jnp.arange(n_starts)[None, :]
    eq &= starts + ngram < n_history[:, None]  # strictly earlier; a continuation exists
    best = jnp.max(jnp.where(eq, starts, -1), axis=1)
    return best >= 0, best + ngram


def lookup_continuation(history, n_history, ngram_sizes: Sequence[int]):
    """(n_avail [B], cont [B], which [B]): continuation of the first matching n-gram size
    in `ngram_sizes` (tried in order; `which` is its index there, 0 when none matched)."""
    found = jnp.zeros(n_history.shape, bool)
    cont = jnp.zeros(n_history.shape, jnp.int32)
    which = jnp.zeros(n_history.shape, jnp.int32)
    for i, n in enumerate(ngram_sizes):
        f, c = ngram_match(history, n_history, n)
        new = f & ~found
        cont = jnp.where(new, c, cont)
        which = jnp.where(new, i, which)
        found = found | f
    n_avail = jnp.where(found, n_history - cont, 0)
    return n_avail.astype(jnp.int32), cont, which


@functools.lru_cache(maxsize=None)  # equal settings -> the same object -> no re-jit
def prompt_lookup(max_ngram: int = 3, min_ngram: int = 1) -> Drafter:
    """Prompt-lookup decoding: copy what followed the latest earlier match of the suffix.

    Tries n-gram sizes max_ngram..min_ngram and drafts the tokens that followed the most
    recent earlier occurrence of the longest matching suffix. No model, deterministic
    (q is one-hot), vectorised over the batch: O(B * S * max_ngram) compares per step.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram=}, {max_ngram=}")
    sizes = tuple(range(max_ngram, min_ngram - 1, -1))

    def available(state, ctx, k_max):
        del state
        n_avail, _, which = lookup_continuation(ctx.history, ctx.n_history, sizes)
        return Availability(jnp.where(ctx.active, jnp.minimum(n_avail, k_max), 0), which)

    def propose(state, target, caches, ctx, k, sampling, key):
        del target, sampling, key
        n_avail, cont, _ = lookup_continuation(ctx.history, ctx.n_history, sizes)
        idx = jnp.clip(cont[:, None] + jnp.arange(k)[None, :], 0, ctx.history.shape[1] - 1)
        tokens = jnp.take_along_axis(ctx.history, idx, axis=1)
        n = jnp.where(ctx.active, jnp.minimum(n_avail, k), 0)
        tokens = jnp.where(jnp.arange(k)[None, :] < n[:, None], tokens, 0)
        return Draft(tokens.astype(jnp.int32), n.astype(jnp.int32), None), state, caches

    return Drafter(name=f"prompt_lookup(n={max_ngram}..{min_ngram})", init=_no_state,
                   prefill=_keep_state, available=available, propose=propose,
                   observe=_keep_state, uses_model=False, n_buckets=len(sizes))


# ------------------------------------------------------------------- autoregressive drafting
def _draft_tokens(step_fn, first_logits, ctx: DraftContext, k: int, sampling: SamplingConfig,
                  key, min_confidence: float, carry0):
    """Sample k tokens autoregressively from `step_fn`; stops early where confidence is low.

    step_fn(carry, tokens[B], i) -> (logits [B, V], carry) feeds drafted token i-1 and
    returns the logits for token i. Drafting of a row stops (n[b] = i) once the draft's
    probability of its own pick falls below `min_confidence`; the loop ends when every
    row has stopped, so a weak draft also saves draft compute.
    """
    b, v = first_logits.shape
    keep_probs = not sampling.greedy

    def pick(logits, i):
        tok = sample(logits, jax.random.fold_in(key, i), sampling)
        q = token_probs(logits, sampling) if keep_probs else None  # what tok was drawn from
        conf = None
        if min_confidence > 0:
            conf = jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), -1),
                                       tok[:, None], axis=1)[:, 0]
        return tok, q, conf

    tokens = jnp.zeros((b, k), jnp.int32)
    probs = jnp.zeros((b, k, v), jnp.float32) if keep_probs else None
    n = jnp.zeros((b,), jnp.int32)
    going = ctx.active

    def cond(c):
        i, _, _, _, going, _, _ = c
        return (i < k) & jnp.any(going)

    def body(c):
        i, tokens, probs, n, going, logits, carry = c
        tok, q, conf = pick(logits, i)
        going = going & (conf >= min_confidence) if min_confidence > 0 else going
        tokens = tokens.at[:, i].set(jnp.where(going, tok, 0))
        if keep_probs:
            probs = probs.at[:, i].set(q)
        n = n + going
        logits, carry = jax.lax.cond(i + 1 < k, lambda: step_fn(carry, tok, i + 1),
                                     lambda: (logits, carry))
        return i + 1, tokens, probs, n, going, logits, carry

    c0 = (jnp.int32(0), tokens, probs, n, going, first_logits, carry0)
    _, tokens, probs, n, _, _, carry = jax.lax.while_loop(cond, body, c0)
    return Draft(tokens, n, probs), carry


@functools.lru_cache(maxsize=None)
def self_speculative(layers: tuple[int, ...], min_confidence: float = 0.0,
                     name: str | None = None) -> Drafter:
    """Draft with the target's own `layers` (early exit or layer skipping), shared head.

    The draft network is `layer_subset_model(target, layers)`: the same weights, the
    shared final norm + LM head, and the target's KV caches of those layers. That sharing
    is exact for early exit (layers 0..L-1 see the same inputs as in the target); with
    skipped layers the context K/V of later layers come from the full model, which only
    changes how good the guess is, never the output (verification is exact). Draft K/V
    are written at positions >= the pending token and are overwritten by verification.
    """
    ids = tuple(int(i) for i in layers)
    if not 0.0 <= min_confidence < 1.0:
        raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")

    def init(target, batch, max_len, max_draft):
        del batch, max_len, max_draft
        layer_subset.validate_layers(target.config.n_layers, ids)
        return ()

    def available(state, ctx, k_max):
        del state
        return _always(ctx, k_max)

    def propose(state, target, caches, ctx, k, sampling, key):
        sub = layer_subset.layer_subset_model(target, ids)
        lens = ctx.n_history - 1  # tokens in the cache; the pending one sits at lens
        n_new = ctx.active.astype(jnp.int32)

        def step(sub_states, tok, i):
            out = forward(sub, tok[:, None], cache_states=sub_states, start=lens + i,
                          n_new=n_new, logits="last")
            return out.logits, out.cache_states

        pending = jnp.take_along_axis(ctx.history, lens[:, None], axis=1)[:, 0]
        first_logits, sub_states = step(layer_subset.take_states(caches, ids), pending, 0)
        draft, sub_states = _draft_tokens(step, first_logits, ctx, k, sampling, key,
                                          min_confidence, sub_states)
        return draft, state, layer_subset.put_states(caches, ids, sub_states)

    label = name or f"self_spec(layers={_describe_layers(ids)})"
    return Drafter(name=label, init=init, prefill=_keep_state, available=available,
                   propose=propose, observe=_keep_state, uses_model=True)


def early_exit(n_layers: int, min_confidence: float = 0.0) -> Drafter:
    """Self-speculative drafting with the first `n_layers` layers and the shared head."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    return self_speculative(tuple(range(n_layers)), min_confidence,
                            name=f"early_exit({n_layers})")


def _always(ctx: DraftContext, k_max: int) -> Availability:
    """A model drafter can always draft k_max tokens (one confidence class)."""
    n = jnp.where(ctx.active, k_max, 0).astype(jnp.int32)
    return Availability(n, jnp.zeros_like(n))


def _describe_layers(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids)) if len(ids) <= 6 else f"{len(ids)} of them"


# ----------------------------------------------------------------------- separate draft model
def model_drafter(draft_model: Model, min_confidence: float = 0.0,
                  name: str = "draft_model") -> Drafter:
    """A separate (small) model with the target's vocabulary, keeping its own KV caches.

    State = (draft model, its cache states); the model travels through jit as data. The
    first draft step feeds the last two tokens (the previous step's bonus token may be
    missing from the draft cache), and `observe` feeds the pending token on steps that
    draft nothing, so the draft cache never falls behind.
    Reuse the returned object across calls: a new one means a new compilation.
    """
    if not 0.0 <= min_confidence < 1.0:
        raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")

    def init(target, batch, max_len, max_draft):
        if draft_model.config.vocab_size != target.config.vocab_size:
            raise ValueError("draft_model must share the target's vocabulary: vocab_size "
                             f"{draft_model.config.vocab_size} != "
                             f"{target.config.vocab_size}")
        dm = rollback.with_rollback_slack(draft_model, max_draft)
        rollback.check_rollback_cached(dm, max_draft)
        return {"model": dm, "caches": dm.init_cache(batch, max_len)}

    def prefill(state, target, tokens, lengths):
        del target
        out = forward(state["model"], tokens, cache_states=state["caches"], n_new=lengths,
                      logits="none")
        return {**state, "caches": out.cache_states}

    def available(state, ctx, k_max):
        del state
        return _always(ctx, k_max)

    def propose(state, target, caches, ctx, k, sampling, key):
        del target
        dm = state["model"]
        lens = ctx.n_history - 1
        dcaches = rollback.truncate_states(dm, state["caches"], lens - 1)
        n_one = ctx.active.astype(jnp.int32)
        # last committed token (position lens - 1; prompts are never empty, so lens >= 1)
        # and the pending token (position lens)
        idx = lens[:, None] - 1 + jnp.arange(2)[None, :]
        pair = jnp.take_along_axis(ctx.history, jnp.maximum(idx, 0), axis=1)
        first = forward(dm, pair, cache_states=dcaches, start=lens - 1,
                        n_new=2 * n_one, logits="last")

        def step(dcaches, tok, i):
            out = forward(dm, tok[:, None], cache_states=dcaches, start=lens + i,
                          n_new=n_one, logits="last")
            return out.logits, out.cache_states

        draft, dcaches = _draft_tokens(step, first.logits, ctx, k, sampling, key,
                                       min_confidence, first.cache_states)
        return draft, {**state, "caches": dcaches}, caches

    def observe(state, target, caches, ctx):
        del target, caches
        lens = ctx.n_history - 1
        pending = jnp.take_along_axis(ctx.history, lens[:, None], axis=1)
        dcaches = rollback.truncate_states(state["model"], state["caches"], lens)
        out = forward(state["model"], pending, cache_states=dcaches, start=lens,
                      n_new=ctx.active.astype(jnp.int32), logits="none")
        return {**state, "caches": out.cache_states}

    return Drafter(name=name, init=init, prefill=prefill, available=available,
                   propose=propose, observe=observe, uses_model=True)
