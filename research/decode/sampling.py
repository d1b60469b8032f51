"""Next-token selection: greedy, or temperature / top-k / top-p sampling with explicit keys.

The sampling settings' bounds live here, once (`check_sampling`): `SamplingConfig`, the
serving engine's `SamplingParams` (research/serving/api.py), the server's pydantic models
(research/serving/protocol.py) and the CLI all validate through it, so a setting one of
them takes the others take too, and every refusal names the field.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

MAX_TEMPERATURE = 100.0  # the library's bound (beyond it every row is all but uniform)
OPENAI_MAX_TEMPERATURE = 2.0  # the OpenAI schema's bound, which the HTTP server keeps
SAMPLING_FIELDS = ("temperature", "top_k", "top_p")


class SamplingError(ValueError):
    """A sampling setting out of its bounds: `field` names it, `bound` says what it must
    be (e.g. "must be a number in [0, 100]"), `value` is what it was."""

    def __init__(self, field: str, bound: str, value):
        super().__init__(f"{field} {bound}, got {value!r}")
        self.field, self.bound, self.value = field, bound, value


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def sampling_bound(field: str, value, *, vocab_size: int | None = None,
                   max_temperature: float = MAX_TEMPERATURE) -> str | None:
    """What `value` of sampling setting `field` must be, if it is not (else None):
    temperature a number in [0, max_temperature] (0 = greedy); top_k an integer >= 0
    (0 = off), at most `vocab_size` when given; top_p a number in (0, 1] (1 = off)."""
    if field == "temperature":
        if not (_real(value) and 0.0 <= value <= max_temperature):
            return f"must be a number in [0, {max_temperature:g}]"
    elif field == "top_k":
        if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                and value >= 0):
            return "must be an integer >= 0 (0 = off)"
        if vocab_size is not None and value > vocab_size:
            return f"must be at most the vocabulary size {vocab_size} (0 = off)"
    elif field == "top_p":
        if not (_real(value) and 0.0 < value <= 1.0):
            return "must be a number in (0, 1]"
    else:
        raise ValueError(f"field must be one of {SAMPLING_FIELDS}, got {field!r}")
    return None


def check_sampling(temperature=0.0, top_k=0, top_p=1.0, *, vocab_size: int | None = None,
                   max_temperature: float = MAX_TEMPERATURE) -> None:
    """The one validation of sampling settings: SamplingError naming the first setting
    out of its bounds (`sampling_bound`)."""
    for field, value in zip(SAMPLING_FIELDS, (temperature, top_k, top_p)):
        bound = sampling_bound(field, value, vocab_size=vocab_size,
                               max_temperature=max_temperature)
        if bound is not None:
            raise SamplingError(field, bound, value)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature == 0 means greedy; top_k == 0 and top_p == 1 disable those filters
    (bounds: `check_sampling`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: Float[Array, "B V"], cfg: SamplingConfig) -> Array:
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(logits, min(cfg.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # smallest logit still inside the nucleus (the top token is always kept)
        keep = mass_before < cfg.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def sample(logits: Float[Array, "B V"], key: jax.Array, cfg: SamplingConfig) -> Array:
    """Next token per row, int32 [B]."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filter_logits(logits, cfg), axis=-1).astype(jnp.int32)


def token_probs(logits: Float[Array, "B V"], cfg: SamplingConfig) -> Array:
    """The exact distribution `sample` draws from (one-hot argmax when greedy)."""
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
    return jax.nn.softmax(filter_logits(logits, cfg), axis=-1)


def filter_logits_per_row(logits: Float[Array, "B V"], temperature: Float[Array, "B"],
                          top_k: Array, top_p: Float[Array, "B"]) -> Array:
    """`filter_logits` with each row's own temperature (> 0), top-k (0 = off) and top-p
    (1 = off): one compiled shape serves every mix of per-request settings."""
    v = logits.shape[-1]
    logits = logits.astype(jnp.float32) / temperature[:, None]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(sorted_logits, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=1)
    kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_logits = jnp.where(sorted_logits < kth, -jnp.inf, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < top_p[:, None]  # the top token is always kept
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    cutoff = jnp.where(top_p[:, None] < 1.0, cutoff, -jnp.inf)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


# Candidates a sampled row's top-k / top-p cutoff is looked for among (`lax.top_k`, ~3 ms
# on [8, 49152] on a 2-core CPU, against ~64 ms for a full sort). A row whose cutoff lies
# beyond them (a nucleus wider than this, or top_k larger) falls back to the full sort.
SAMPLE_CANDIDATES = 1024


def _cutoff(sorted_vals: Float[Array, "B C"], log_z: Float[Array, "B"], kth: Array,
            top_p: Float[Array, "B"]) -> tuple[Array, Array]:
    """(smallest logit kept [B], whether `sorted_vals` sufficed [B]) for the nucleus of a
    row's top-k-filtered distribution, from its C largest logits in descending order.

    kth: [B] the top-k threshold (-inf: off); log_z: log of the filtered distribution's
    normaliser over the whole vocabulary, so C < V candidates give the same masses as a
    full sort."""
    vals = jnp.where(sorted_vals >= kth[:, None], sorted_vals, -jnp.inf)
    probs = jnp.exp(vals - log_z[:, None])
    mass = jnp.cumsum(probs, axis=-1)
    keep = (mass - probs) < top_p[:, None]  # the top token is always kept
    cutoff = jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1)
    nucleus_ends = mass[:, -1] >= top_p  # the next candidate would be dropped
    set_ends = sorted_vals[:, -1] < kth  # the top-k set lies inside the candidates
    nucleus = top_p < 1.0
    return (jnp.where(nucleus, cutoff, kth),
            jnp.where(nucleus, nucleus_ends | set_ends, True))


def sample_per_row(logits: Float[Array, "B V"], temperature: Float[Array, "B"], top_k: Array,
                   top_p: Float[Array, "B"], key_data: Array,
                   candidates: int = SAMPLE_CANDIDATES) -> Array:
    """Next token per row, int32 [B]: greedy where temperature == 0, else a draw from the
    row's filtered distribution with the row's own key (`key_data` [B, 2] uint32), so a
    row's token does not depend on the other rows of the batch.

    One compiled shape serves any mix of settings, and only what a batch needs runs: an
    all-greedy batch takes the argmax alone (the draw sits behind `lax.cond`); sampled
    rows find their cutoff among the `candidates` largest logits (`lax.top_k`), and the
    full-vocabulary sort runs only when some row's nucleus or top-k reaches past them.
    Either way a row's cutoff and draw are the same (Gumbel-max over the whole vocabulary
    with the row's key, as `jax.random.categorical` draws), whichever path found it."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    hot = temperature > 0

    def draw():
        v = logits.shape[-1]
        scaled = logits.astype(jnp.float32) / jnp.where(hot, temperature, 1.0)[:, None]
        c = min(candidates, v)
        top = jax.lax.top_k(scaled, c)[0]
        k_in = (top_k > 0) & (top_k <= c)
        kth = jnp.where(k_in, jnp.take_along_axis(top, jnp.clip(top_k - 1, 0, c - 1)[:, None],
                                                  axis=1)[:, 0], -jnp.inf)

        def full_kth():
            full = jnp.sort(scaled, axis=-1)[:, ::-1]
            return jnp.take_along_axis(full, jnp.clip(top_k - 1, 0, v - 1)[:, None],
                                       axis=1)[:, 0]

        wide_k = hot & (top_k > c)
        kth = jnp.where(wide_k, jax.lax.cond(wide_k.any(), full_kth, lambda: kth), kth)
        log_z = jax.nn.logsumexp(jnp.where(scaled >= kth[:, None], scaled, -jnp.inf), axis=-1)
        cutoff, complete = _cutoff(top, log_z, kth, top_p)

        def full_cutoff():
            return _cutoff(jnp.sort(scaled, axis=-1)[:, ::-1], log_z, kth, top_p)[0]

        short = hot & ~complete
        cutoff = jnp.where(short, jax.lax.cond(short.any(), full_cutoff, lambda: cutoff),
                           cutoff)
        keys = jax.random.wrap_key_data(key_data)
        noise = jax.vmap(lambda k: jax.random.gumbel(k, (v,)))(keys)
        drawn = jnp.argmax(jnp.where(scaled >= cutoff[:, None], scaled + noise, -jnp.inf),
                           axis=-1).astype(jnp.int32)
        return jnp.where(hot, drawn, greedy)

    return jax.lax.cond(hot.any(), draw, lambda: greedy)


def process_logits(logits: Float[Array, "B V"], counts: Float[Array, "B V"], seen: Array,
                   bias: Float[Array, "B V"], presence: Float[Array, "B"],
                   frequency: Float[Array, "B"], repetition: Float[Array, "B"]) -> Array:
    """Per-row logit processors (vLLM / OpenAI semantics), float32 [B, V].

    counts: how often each token was generated so far; seen: tokens in the prompt or the
    output (bool). Repetition (1 = off) divides a seen token's positive logit and
    multiplies its negative one; frequency subtracts count x penalty, presence subtracts
    the penalty once for any generated token; bias is added last (logit_bias)."""
    logits = logits.astype(jnp.float32)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits + bias
