"""Batched prefill + decode under `jit` with a pre-allocated cache.

Prompts of different lengths are right-padded into one [B, T] chunk; each row keeps its
own length, so row b's next token is written at position `lengths[b]`. The decode loop is
a `lax.while_loop` (no host round-trip per token) that ends when every row has hit a stop
token or `max_new_tokens`.

NaN/inf never turn into tokens silently: the loop checks every step's K/V, layer outputs
and logits on device (a few reductions), stops at the first non-finite value, and
`generate` raises a ValueError naming the layer it first appeared in.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model, forward, forward_live
from research.decode.sampling import SamplingConfig, sample

PAD_BUCKET = 16  # prompt chunks are padded to a multiple of this, to bound recompiles
PREFILL_CHUNK = 512  # `generate` prefills longer prompts in pieces of this many tokens


class Generation(NamedTuple):
    tokens: list[list[int]]  # generated ids per row, stop token excluded
    finish_reasons: list[str]  # "stop" or "length"
    prompt_lengths: list[int]


class Decoded(NamedTuple):
    """What `decode_loop` returns (arrays on device)."""

    tokens: jax.Array  # [B, max_new_tokens], 0 after a row's stop
    n_out: jax.Array  # [B] tokens per row, the stop token included
    done: jax.Array  # [B] the row hit a stop token
    lengths: jax.Array  # [B] cache lengths after the loop
    cache_states: tuple
    # [B] int32, -1 while finite: the step whose logits came out NaN/inf (0 = the first
    # logits, from the prefill) and the first layer whose K/V or output did (n_layers =
    # only the logits: final norm / LM head; at step 0 the prefill's layer is not known
    # here, `generate` checks the prefill itself). The loop stops at the first such step.
    nonfinite_step: jax.Array
    nonfinite_layer: jax.Array


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, pad_id: int = 0,
                bucket: int = PAD_BUCKET) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [B, T] int32 tokens and [B] lengths; validates ids."""
    if not prompts:
        raise ValueError("prompts is empty: expected at least one prompt")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError(f"prompt {int(lengths.argmin())} is empty: every prompt needs a token")
    tokens = np.full((len(prompts), round_up(int(lengths.max()), bucket)), pad_id, np.int32)
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"prompt {i} must hold integer token ids, got {ids.dtype}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        tokens[i, :len(p)] = ids
    return tokens, lengths


@jax.jit
def prefill(model: Model, tokens: jax.Array, lengths: jax.Array, cache_states: tuple):
    """Write the prompts into the cache; logits [B, V] at each row's last prompt token."""
    out = forward(model, tokens, cache_states=cache_states, n_new=lengths, logits="last")
    return out.logits, out.cache_states


@jax.jit
def _prefill_checked(model: Model, tokens: jax.Array, lengths: jax.Array, cache_states: tuple):
    """`prefill` plus per row the first layer with non-finite K/V or output (-1: none)."""
    out = forward(model, tokens, cache_states=cache_states, n_new=lengths, logits="last",
                  check_finite=True)
    return out.logits, out.cache_states, out.nonfinite_layer


@functools.partial(jax.jit, static_argnames=("live",))
def prefill_piece(model: Model, tokens: jax.Array, start: jax.Array, n_new: jax.Array,
                  cache_states: tuple, live: int | None = None):
    """One piece of a prompt (row b's tokens at start[b] + t, the first n_new[b] real):
    (logits at each row's last real token, cache states, first non-finite layer or -1).
    live: attend over the first `live` slots of every layer's cache only
    (`Model.live_slots`; None: all): the key blocks past them are masked for every row of
    a piece that ends by slot `live`, so they are skipped instead of read."""
    out = forward_live(model, tokens, cache_states=cache_states, live=live, start=start,
                       n_new=n_new, logits="last", check_finite=True)
    return out.logits, out.cache_states, out.nonfinite_layer


def prefill_in_chunks(model: Model, tokens, lengths, cache_states: tuple,
                      chunk: int = PREFILL_CHUNK):
    """`_prefill_checked` in pieces of `chunk` tokens: (logits [B, V] at each row's last
    prompt token, cache states, first non-finite layer per row or -1).

    Attention of a chunk costs chunk x cache capacity, so one 4 x 8192 piece asked XLA for
    ~31 GB (scores over the whole cache for every prompt token); pieces bound it, and the
    result is the same (each piece reads what the earlier ones wrote). A piece attends over
    the live slots only (`Model.live_slots`), so the masked key blocks past it cost nothing."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    b, t = tokens.shape
    if t <= chunk:
        return _prefill_checked(model, jnp.asarray(tokens), jnp.asarray(lengths),
                                cache_states)
    logits = bad = None
    for c0 in range(0, t, chunk):
        piece = np.zeros((b, chunk), np.int32)
        piece[:, :min(chunk, t - c0)] = tokens[:, c0:c0 + chunk]
        n_new = np.clip(lengths - c0, 0, chunk).astype(np.int32)
        args = (model, jnp.asarray(piece), jnp.full((b,), c0, jnp.int32),
                jnp.asarray(n_new), cache_states)
        live = model.live_slots(cache_states, c0 + chunk, chunk)
        out, cache_states, flags = prefill_piece(*args, live=live)
        here = jnp.asarray((lengths - 1 >= c0) & (lengths - 1 < c0 + chunk))
        logits = out if logits is None else jnp.where(here[:, None], out, logits)
        bad = flags if bad is None else jnp.where(bad >= 0, bad, flags)
    return logits, cache_states, bad


@jax.jit
def decode_step(model: Model, tokens: jax.Array, lengths: jax.Array, active: jax.Array,
                cache_states: tuple):
    """One token per row at position lengths[b]; inactive rows write nothing."""
    out = forward(model, tokens[:, None], cache_states=cache_states, start=lengths,
                  n_new=active.astype(jnp.int32), logits="last")
    return out.logits, out.cache_states


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "sampling", "stop_tokens"))
def decode_loop(model, first_logits, lengths, cache_states, key, *, max_new_tokens,
                sampling, stop_tokens):
    """Sample up to `max_new_tokens` per row from prefilled `cache_states`, the first from
    `first_logits` [b, V]; a row stops at a stop token (later slots hold 0), every row
    at the first non-finite logits / K/V / layer output (see `Decoded`; callers raise
    with `raise_if_nonfinite`)."""
    b = lengths.shape[0]
    n_layers = model.config.n_layers
    stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)

    def pick(logits, step, done):
        tok = sample(logits, jax.random.fold_in(key, step), sampling)
        return jnp.where(done, 0, tok), done | jnp.isin(tok, stops)

    def flag(logits, layer, step, active, bad_step, bad_layer):
        """Record (step, layer) for active rows that just went non-finite."""
        layer = jnp.where(layer >= 0, layer, n_layers)
        new = active & (bad_step < 0) & ((layer < n_layers) | ~jnp.isfinite(logits).all(-1))
        return jnp.where(new, step, bad_step), jnp.where(new, layer, bad_layer)

    none = jnp.full((b,), -1, jnp.int32)
    bad_step0, bad_layer0 = flag(first_logits, none, 0, jnp.ones((b,), bool), none, none)
    tok0, done0 = pick(first_logits, 0, jnp.zeros((b,), bool))
    out0 = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok0)
    n_out0 = jnp.ones((b,), jnp.int32)

    def cond(carry):
        step, _, _, done, _, _, bad_step, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done) & jnp.all(bad_step < 0)

    def body(carry):
        step, out, n_out, done, lens, states, bad_step, bad_layer = carry
        active = ~done
        fwd = forward(model, out[:, step - 1][:, None], cache_states=states, start=lens,
                      n_new=active.astype(jnp.int32), logits="last", check_finite=True)
        bad_step, bad_layer = flag(fwd.logits, fwd.nonfinite_layer, step, active, bad_step,
                                   bad_layer)
        tok, new_done = pick(fwd.logits, step, done)
        out = out.at[:, step].set(tok)
        lens = lens + active
        n_out = n_out + active
        return step + 1, out, n_out, new_done, lens, fwd.cache_states, bad_step, bad_layer

    carry = (jnp.int32(1), out0, n_out0, done0, lengths, cache_states, bad_step0, bad_layer0)
    _, out, n_out, done, lens, states, bad_step, bad_layer = jax.lax.while_loop(
        cond, body, carry)
    return Decoded(out, n_out, done, lens, states, bad_step, bad_layer)


def raise_if_nonfinite(decoded: Decoded, n_layers: int, prefill_layer=None) -> None:
    """ValueError naming where NaN/inf first appeared, if anywhere: the prefill's layer
    (`prefill_layer` [B] from `forward(check_finite=True)`, -1 = finite) or the decode
    step and layer `decode_loop` recorded."""
    steps, layers = np.asarray(decoded.nonfinite_step), np.asarray(decoded.nonfinite_layer)
    pre = None if prefill_layer is None else np.asarray(prefill_layer)
    if pre is not None and (pre >= 0).any():
        row = int(np.argmax(pre >= 0))
        where, layer = "the prefill (the prompt)", int(pre[row])
    elif (steps >= 0).any():
        row = int(np.argmax(steps >= 0))
        step, layer = int(steps[row]), int(layers[row])
        where = "the prefill (the prompt)" if step == 0 else f"decode step {step}"
    else:
        return
    if layer >= n_layers:
        raise ValueError(f"non-finite logits (NaN/inf) at {where}, row {row}, although every "
                         "layer's K/V and output were finite: check the final norm and the "
                         "LM head (params['final_norm'], params['lm_head'] or the tied "
                         "params['embed'])")
    raise ValueError(f"non-finite values (NaN/inf) first appeared in layer {layer} (its K/V "
                     f"or its output) at {where}, row {row}: check params['layers'][{layer}] "
                     "and that layer's KV cache")


def prepare_prompts(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    key: jax.Array | None, sampling: SamplingConfig, max_len: int | None):
    """Validate a generation request: (key, padded tokens, lengths, cache max_len).

    Greedy decoding may omit `key`; sampling must pass one. The cache must hold every
    prompt plus max_new_tokens, within the model's max_position."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if key is None:
        if not sampling.greedy:
            raise ValueError("sampling with temperature > 0 needs an explicit PRNG `key`")
        key = jax.random.key(0)
    tokens, lengths = pad_prompts(prompts, model.config.vocab_size)
    needed = int(lengths.max()) + max_new_tokens
    max_len = max_len or max(round_up(needed, PAD_BUCKET), tokens.shape[1])
    if needed > max_len:
        raise ValueError(f"prompt of {int(lengths.max())} tokens + max_new_tokens="
                         f"{max_new_tokens} exceeds the cache max_len={max_len}")
    if needed > model.config.max_position:
        raise ValueError(f"prompt + max_new_tokens = {needed} exceeds the model's "
                         f"max_position={model.config.max_position}")
    return key, tokens[:, :max_len], lengths, max_len  # only padding is cut (checked)


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             key: jax.Array | None = None, sampling: SamplingConfig = SamplingConfig(),
             stop_tokens: Sequence[int] = (), max_len: int | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> Generation:
    """Generate continuations of token-id `prompts` (greedy unless `sampling` says otherwise).

    prefill_chunk: prompts longer than this are prefilled in pieces (`prefill_in_chunks`).
    max_len: cache length per sequence; default = longest prompt + max_new_tokens rounded
    up. A prompt that does not fit (prompt + max_new_tokens > max_len) is an error.
    NaN/inf in the K/V, a layer's output or the logits is a ValueError naming the layer.
    """
    key, tokens, lengths, max_len = prepare_prompts(model, prompts, max_new_tokens, key,
                                                    sampling, max_len)
    states = model.init_cache(len(prompts), max_len)
    # a model holding one weight set per phase (research.dynacore) prefills with its
    # prefill set and decodes from that cache with its decode set; others are unchanged
    logits, states, bad = prefill_in_chunks(model.prefill_model, tokens, lengths, states,
                                            prefill_chunk)
    decoded = decode_loop(
        model.decode_model, logits, jnp.asarray(lengths), states, key, max_new_tokens=max_new_tokens,
        sampling=sampling, stop_tokens=tuple(int(t) for t in stop_tokens))
    raise_if_nonfinite(decoded, model.config.n_layers, bad)
    out, n_out, done = (np.asarray(a) for a in decoded[:3])
    rows = [list(map(int, out[i, :n_out[i] - int(done[i])])) for i in range(len(prompts))]
    reasons = ["stop" if d else "length" for d in done]
    return Generation(rows, reasons, lengths.tolist())


def generate_text(model: Model, tokenizer, prompts: Sequence[str], *, chat: bool = True,
                  **kwargs) -> list[str]:
    """Text in, text out; `chat` wraps each prompt in the model's chat template."""
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    ids = [tokenizer.encode(p) for p in prompts]
    stops = kwargs.pop("stop_tokens", None)
    if stops is None:
        stops = default_stop_tokens(tokenizer)
    gen = generate(model, ids, stop_tokens=stops, **kwargs)
    return [tokenizer.decode(t, skip_special=True) for t in gen.tokens]


def default_stop_tokens(tokenizer) -> tuple[int, ...]:
    """EOS plus the chat end-of-turn token when the vocabulary has one."""
    ids = {tokenizer.eos_id, tokenizer.token_to_id("<|im_end|>")}
    return tuple(sorted(i for i in ids if i is not None))
