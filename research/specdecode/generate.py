"""Speculative decoding: draft k tokens, verify them in one target forward, keep a prefix.

One jitted `lax.while_loop` (no host round-trip per token). Each step:

  1. the drafter says how many tokens each row could draft (`available`);
  2. the policy picks k from `policy.draft_lengths` (one compiled branch per k, selected
     in place by `_select`; k = 0 is a plain decode step);
  3. the branch drafts k tokens, runs the target on [pending, d_1..d_k] (T = k + 1) over
     the KV cache at start = lengths with per-row n_new = 1 + drafted, and accepts a prefix
     per row by exact speculative sampling (`verify.verify_drafts`);
  4. every row advances by its own accepted + 1 tokens; the rejected tokens' K/V are
     rolled back by not advancing the length (see `rollback`).

Sampling uses the same filtered distribution as plain decoding (`token_probs`), so the
output is distributed exactly as `research.decode.generate.generate`'s; greedy output is
identical token for token. The random stream differs from plain decoding's, so sampled
sequences for the same key are different draws from the same distribution.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model, forward
from research.decode.generate import prefill, prepare_prompts
from research.decode.sampling import SamplingConfig, sample, token_probs
from research.specdecode import policy as pol
from research.specdecode.drafters import Draft, DraftContext, Drafter
from research.specdecode.rollback import (check_rollback_cached, truncate_states,
                                          with_rollback_slack)
from research.specdecode.verify import verify_drafts


class SpecStats(NamedTuple):
    steps: int  # target forward passes after prefill (loop iterations)
    active_steps: list[int]  # per row: target forwards while the row was generating
    drafted: list[int]  # per row: drafted tokens sent to verification
    accepted: list[int]  # per row: drafted tokens accepted
    branch_counts: dict[int, int]  # draft length k -> steps that used it

    @property
    def acceptance_rate(self) -> float:
        d = sum(self.drafted)
        return sum(self.accepted) / d if d else float("nan")


class SpecGeneration(NamedTuple):
    tokens: list[list[int]]  # generated ids per row, stop token excluded
    finish_reasons: list[str]  # "stop" or "length"
    prompt_lengths: list[int]
    stats: SpecStats

    def tokens_per_forward(self) -> float:
        """Tokens emitted per target forward in the decode phase, over all rows (plain
        decoding: 1.0; the first token comes from the prefill and is not counted)."""
        emitted = sum(max(len(t) + (r == "stop") - 1, 0)
                      for t, r in zip(self.tokens, self.finish_reasons))
        forwards = sum(self.stats.active_steps)
        return emitted / forwards if forwards else float("nan")


class _Step(NamedTuple):
    """What a branch returns: the same structure for every draft length."""
    caches: tuple
    drafter_state: object
    emitted: jax.Array  # [B, max_draft + 1]: accepted drafts then the next token
    n_drafted: jax.Array  # [B]
    n_accepted: jax.Array  # [B]


def _verify_branch(k: int, *, target, drafter: Drafter, sampling: SamplingConfig,
                   max_draft: int):
    """Branch for draft length k: draft, one target forward of k + 1 tokens, verify."""

    def run(caches, dstate, ctx: DraftContext, limit, key):
        b = ctx.n_history.shape[0]
        lens = ctx.n_history - 1  # tokens in the cache; the pending one goes at lens
        key_draft, key_verify = jax.random.split(key)
        caches = truncate_states(target, caches, lens)  # roll back the last rejections
        if k == 0:
            dstate = drafter.observe(dstate, target, caches, ctx)
            draft = Draft(jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32), None)
        else:
            draft, dstate, caches = drafter.propose(dstate, target, caches, ctx, k,
                                                    sampling, key_draft)
            caches = truncate_states(target, caches, lens)  # drop the drafter's scratch
        n_drafted = jnp.where(ctx.active, jnp.minimum(draft.n, limit), 0)
        pending = jnp.take_along_axis(ctx.history, lens[:, None], axis=1)
        chunk = jnp.concatenate([pending, draft.tokens], axis=1)  # [B, k + 1]
        out = forward(target, chunk, cache_states=caches, start=lens,
                      n_new=jnp.where(ctx.active, n_drafted + 1, 0), logits="all")
        v = out.logits.shape[-1]
        probs = token_probs(out.logits.reshape(b * (k + 1), v), sampling)
        verdict = verify_drafts(probs.reshape(b, k + 1, v), draft.tokens, draft.probs,
                                n_drafted, key_verify, greedy=sampling.greedy)
        i = jnp.arange(max_draft + 1)[None, :]
        padded = jnp.pad(draft.tokens, ((0, 0), (0, max_draft + 1 - k)))
        emitted = jnp.where(i < verdict.n_accepted[:, None], padded,
                            jnp.where(i == verdict.n_accepted[:, None],
                                      verdict.next_token[:, None], 0))
        return _Step(out.cache_states, dstate, emitted.astype(jnp.int32), n_drafted,
                     verdict.n_accepted)

    return run


def _select(branch, branches, caches, dstate, ctx, limit, key, *, b: int, width: int) -> _Step:
    """Run branches[branch] as a chain of while loops that iterate 0 or 1 times.

    Equivalent to `lax.switch`, but XLA updates a while loop's carry in place, whereas a
    conditional copies every layer's KV cache on each call (its per-branch operand
    tuples alias), which cost 7-14% of a decode step on CPU.
    """
    zeros = jnp.zeros((b,), jnp.int32)
    s = (branch, _Step(caches, dstate, jnp.zeros((b, width), jnp.int32), zeros, zeros))
    for j, run in enumerate(branches):
        s = jax.lax.while_loop(
            lambda s, j=j: s[0] == j,
            lambda s, run=run: (jnp.int32(-1), run(s[1].caches, s[1].drafter_state, ctx,
                                                   limit, key)), s)
    return s[1]


class _Carry(NamedTuple):
    step: jax.Array
    history: jax.Array  # [B, S]
    n_history: jax.Array  # [B]
    n_out: jax.Array  # [B] tokens generated (incl. the pending one and any stop token)
    stopped: jax.Array  # [B] the row emitted a stop token
    caches: tuple
    drafter_state: object
    acc_stats: pol.AcceptanceStats
    drafted: jax.Array
    accepted: jax.Array
    active_steps: jax.Array
    branch_counts: jax.Array


def _finished(c: _Carry, max_new_tokens: int):
    return c.stopped | (c.n_out >= max_new_tokens)


def _commit(c: _Carry, s: _Step, stops, max_new_tokens: int):
    """Append each active row's emitted tokens, truncated at a stop token / the budget."""
    active = ~_finished(c, max_new_tokens)
    width = s.emitted.shape[1]
    i = jnp.arange(width)[None, :]
    count = s.n_accepted + 1
    is_stop = jnp.isin(s.emitted, stops) & (i < count[:, None])
    hit_stop = jnp.any(is_stop, axis=1)
    count = jnp.where(hit_stop, jnp.argmax(is_stop, axis=1) + 1, count)
    count = jnp.where(active, jnp.minimum(count, max_new_tokens - c.n_out), 0)
    slots = jnp.where(i < count[:, None], c.n_history[:, None] + i, c.history.shape[1])
    rows = jnp.broadcast_to(jnp.arange(c.history.shape[0])[:, None], slots.shape)
    history = c.history.at[rows, slots].set(s.emitted, mode="drop")
    return history, c.n_history + count, c.n_out + count, c.stopped | (active & hit_stop)


@functools.partial(jax.jit, static_argnames=("drafter", "policy", "sampling", "stop_tokens",
                                             "max_new_tokens"))
def _spec_loop(target: Model, drafter_state, first_logits, history, lengths, caches, key, *,
               drafter: Drafter, policy: pol.DraftLengthPolicy, sampling: SamplingConfig,
               stop_tokens: tuple[int, ...], max_new_tokens: int):
    b = lengths.shape[0]
    stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
    tok0 = sample(first_logits, jax.random.fold_in(key, 0), sampling)
    history = history.at[jnp.arange(b), lengths].set(tok0)
    stopped0 = jnp.isin(tok0, stops)
    ks = policy.draft_lengths
    branches = [_verify_branch(k, target=target, drafter=drafter, sampling=sampling,
                               max_draft=policy.max_draft) for k in ks]

    def cond(c: _Carry):
        return ~jnp.all(_finished(c, max_new_tokens))

    def body(c: _Carry):
        active = ~_finished(c, max_new_tokens)
        ctx = DraftContext(c.history, c.n_history, active)
        limit = jnp.maximum(max_new_tokens - c.n_out - 1, 0)  # drafts beyond the budget
        avail = drafter.available(c.drafter_state, ctx, policy.max_draft)
        n_avail = jnp.minimum(avail.n, limit)
        branch = pol.choose_branch(policy, c.acc_stats, n_avail, avail.bucket, active)
        s = _select(branch, branches, c.caches, c.drafter_state, ctx, limit,
                    jax.random.fold_in(key, c.step), b=b, width=policy.max_draft + 1)
        history, n_history, n_out, stopped = _commit(c, s, stops, max_new_tokens)
        return _Carry(
            step=c.step + 1, history=history, n_history=n_history, n_out=n_out,
            stopped=stopped,
            caches=s.caches, drafter_state=s.drafter_state,
            acc_stats=pol.update_stats(policy, c.acc_stats, avail.bucket, s.n_drafted,
                                       s.n_accepted, active),
            drafted=c.drafted + s.n_drafted, accepted=c.accepted + s.n_accepted,
            active_steps=c.active_steps + active, branch_counts=c.branch_counts.at[branch].add(1))

    zeros = jnp.zeros((b,), jnp.int32)
    c0 = _Carry(jnp.int32(1), history, lengths + 1, jnp.ones((b,), jnp.int32), stopped0, caches,
                drafter_state, pol.init_stats(b, drafter.n_buckets), zeros, zeros, zeros,
                jnp.zeros((len(ks),), jnp.int32))
    return jax.lax.while_loop(cond, body, c0)


def speculative_generate(model: Model, prompts: Sequence[Sequence[int]], *, drafter: Drafter,
                         max_new_tokens: int, key: jax.Array | None = None,
                         sampling: SamplingConfig = SamplingConfig(),
                         stop_tokens: Sequence[int] = (), max_len: int | None = None,
                         policy: pol.DraftLengthPolicy = pol.DraftLengthPolicy()
                         ) -> SpecGeneration:
    """Like `research.decode.generate.generate`, with drafting + exact verification.

    drafter: e.g. `prompt_lookup()`, `early_exit(8)`, `model_drafter(small_model)`.
    policy: draft lengths, their measured costs, adaptivity (see `DraftLengthPolicy`).
    Greedy output equals `generate`'s token for token; sampled output has the same
    distribution. Ring-buffer (sliding-window) caches get `policy.max_draft` extra slots
    so rejected tokens can be rolled back; any cache that cannot roll back is an error.
    """
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a specdecode Drafter, got {type(drafter).__name__}")
    if not isinstance(policy, pol.DraftLengthPolicy):
        raise TypeError(f"policy must be a DraftLengthPolicy, got {type(policy).__name__}")
    key, tokens, lengths, max_len = prepare_prompts(model, prompts, max_new_tokens, key,
                                                    sampling, max_len)
    model = with_rollback_slack(model, policy.max_draft)
    check_rollback_cached(model, policy.max_draft)
    b = len(prompts)
    states = model.init_cache(b, max_len)
    dstate = drafter.init(model, b, max_len, policy.max_draft)
    logits, states = prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), states)
    dstate = drafter.prefill(dstate, model, jnp.asarray(tokens), jnp.asarray(lengths))
    history = np.zeros((b, max_len + policy.max_draft + 2), np.int32)
    history[:, :tokens.shape[1]] = tokens
    c = _spec_loop(model, dstate, logits, jnp.asarray(history), jnp.asarray(lengths), states,
                   key, drafter=drafter, policy=policy, sampling=sampling,
                   stop_tokens=tuple(int(t) for t in stop_tokens),
                   max_new_tokens=max_new_tokens)
    return _to_generation(c, lengths, policy)


def _to_generation(c: _Carry, lengths: np.ndarray, policy) -> SpecGeneration:
    history, n_out = np.asarray(c.history), np.asarray(c.n_out)
    stopped = np.asarray(c.stopped)
    rows = [list(map(int, history[i, lengths[i]:lengths[i] + n_out[i] - int(stopped[i])]))
            for i in range(len(lengths))]
    stats = SpecStats(steps=int(c.step) - 1, active_steps=np.asarray(c.active_steps).tolist(),
                      drafted=np.asarray(c.drafted).tolist(),
                      accepted=np.asarray(c.accepted).tolist(),
                      branch_counts=dict(zip(policy.draft_lengths,
                                             np.asarray(c.branch_counts).tolist())))
    return SpecGeneration(rows, ["stop" if s else "length" for s in stopped],
                          lengths.tolist(), stats)
