"""Probe queries for fitting a patch: token rows placed right after a context.

Four kinds, all available before any real query arrives:

* generated: continuations sampled from the full-cache reference model (the queries the
  uncompressed model would go on to make about this context);
* reply: for a context that is an open chat user turn, a fixed reply prefix (the chat
  template's end-of-turn + assistant header, `ProbeConfig.reply_prefix`) followed by the
  reference model's sampled reply: the assistant turns a chat server will actually
  serve over this context (in a chat they read the user turn back, as answers do);
* repeat: spans of the context itself re-fed after it (queries that look back for
  specific context content, like a retrieval question does); the spans start at evenly
  spaced offsets, so together they cover the whole context;
* text: spans of other real text (a pool the caller gives, e.g. the calibration split)
  placed after the context: real prose, which the model's own samples are not. On a
  1-bit cache the patch fitted on generated rows cut their held-out KL but not the
  perplexity of real continuations; fitted on text rows it cut both
  (experiments/patchkv/README.md). Non-overlapping spans, drawn without replacement.

Rows are split into fit and held-out sets by whole rows (neighbouring tokens are
correlated, so a token-level split would leak).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model, default_caches
from research.patchkv import layerwise, session
from research.patchkv.session import prefill_batch, tile_states
from research.decode import generate as gen
from research.decode.sampling import SamplingConfig
from research.transforms import CalibrationData


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    # Defaults chosen on a dev split (experiments/patchkv/patchkv.py): repeat rows made the
    # patch worse on real continuations, so by default all probes are generated; 64 rows
    # beat 32 under every eviction press on dev.
    n_generated: int = 64  # sampled continuations per context
    n_repeat: int = 0  # context spans re-fed after the context, per context
    length: int = 64  # tokens per probe row
    temperature: float = 1.0
    top_p: float = 0.95
    holdout: float = 0.25  # fraction of rows (per kind) held out to choose the penalty
    seed: int = 0
    n_reply: int = 0  # sampled assistant replies per context (chat contexts only)
    reply_prefix: tuple = ()  # token ids opening the reply (research.patchkv.tasks)
    n_text: int = 0  # spans of the caller's text pool per context (probe_context(text=))

    @property
    def n_rows(self) -> int:
        return self.n_generated + self.n_repeat + self.n_reply + self.n_text

    def __post_init__(self):
        counts = (self.n_generated, self.n_repeat, self.n_reply, self.n_text)
        if min(counts) < 0 or self.n_rows < 1:
            raise ValueError(f"need n_generated, n_repeat, n_reply, n_text >= 0 and at "
                             f"least one probe row, got {self.n_generated=}, "
                             f"{self.n_repeat=}, {self.n_reply=}, {self.n_text=}")
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")
        if self.n_reply and not 0 < len(self.reply_prefix) < self.length:
            raise ValueError(f"n_reply > 0 needs a reply_prefix of 1 to length-1="
                             f"{self.length - 1} token ids, got {len(self.reply_prefix)}")
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")


class ProbeSet(NamedTuple):
    tokens: np.ndarray  # [P, m] int32, right-padded
    lengths: np.ndarray  # [P] real tokens per row
    context: np.ndarray  # [P] index of the context each row continues
    kind: np.ndarray  # [P] "generated" | "repeat" | "reply"
    holdout: np.ndarray  # [P] bool: used only to choose the penalty

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())


def _holdout_rows(n: int, fraction: float, rng) -> np.ndarray:
    mask = np.zeros(n, bool)
    k = int(round(n * fraction))
    if fraction > 0 and n >= 2:
        k = min(max(k, 1), n - 1)
    mask[rng.permutation(n)[:k]] = True
    return mask


def repeat_rows(context: np.ndarray, n: int, length: int) -> list[np.ndarray]:
    """`n` spans of up to `length` tokens of `context` at evenly spaced starts (first and
    last token included)."""
    span = min(length, len(context))
    starts = np.linspace(0, len(context) - span, n).round().astype(int)
    return [context[s:s + span] for s in starts]


def text_rows(text: np.ndarray, n: int, length: int, rng) -> list[np.ndarray]:
    """`n` non-overlapping `length`-token spans of `text`, at random slots (no repeats)."""
    slots = len(text) // length
    if n > slots:
        raise ValueError(f"text pool of {len(text)} tokens holds {slots} spans of {length} "
                         f"tokens; n_text={n} needs {n * length} tokens")
    return [text[s * length:(s + 1) * length] for s in rng.choice(slots, n, replace=False)]


def generated_rows(reference: Model, states: tuple, last_logits, length_of_context: int,
                   n: int, length: int, sampling: SamplingConfig, key) -> np.ndarray:
    """`n` sampled continuations [n, length] of one prefilled context (batch-1 states)."""
    index = np.zeros(n, np.int32)
    lengths = jnp.full((n,), length_of_context, jnp.int32)
    decoded = gen.decode_loop(reference, jnp.take(last_logits, index, axis=0), lengths,
                              tile_states(states, index), key, max_new_tokens=length,
                              sampling=sampling, stop_tokens=())
    gen.raise_if_nonfinite(decoded, reference.config.n_layers)
    return np.asarray(decoded.tokens, np.int32)


def reply_rows(reference: Model, states: tuple, length_of_context: int, prefix,
               n: int, length: int, sampling: SamplingConfig, key) -> np.ndarray:
    """`n` rows [n, length]: `prefix` appended to one prefilled context (batch-1 states),
    then a sampled reply of `length - len(prefix)` tokens. The prefix is run once and the
    replies branch from it."""
    prefix = np.asarray(prefix, np.int32)
    logits, states = session.append_queries(
        reference, jnp.asarray(prefix[None]), jnp.asarray([length_of_context], jnp.int32),
        jnp.asarray([prefix.size], jnp.int32), states)
    replies = generated_rows(reference, states, logits, length_of_context + prefix.size, n,
                             length - prefix.size, sampling, key)
    return np.concatenate([np.tile(prefix, (n, 1)), replies], axis=1)


def build_probes(reference: Model, contexts: np.ndarray, lengths: np.ndarray,
                 ref_states: tuple, ref_logits, config: ProbeConfig,
                 text: np.ndarray | None = None) -> ProbeSet:
    """Probe rows for every context (right-padded `contexts` [B, T], prefilled by the
    reference into `ref_states` with room for `config.length` more tokens); `text`: the
    token pool of text rows (each context gets its own spans)."""
    rng = np.random.default_rng(config.seed)
    text_rng = np.random.default_rng([config.seed, 1])  # other kinds' rows stay as they were
    sampling = SamplingConfig(temperature=config.temperature, top_p=config.top_p)
    rows, ctx_of, kinds, holdout = [], [], [], []
    for b, n in enumerate(np.asarray(lengths)):
        ctx = np.asarray(contexts[b, :n])
        one = jax.tree.map(lambda a: a[b:b + 1], ref_states)  # this context's caches
        if config.n_generated:
            key = jax.random.fold_in(jax.random.key(config.seed), b)
            gen_rows = generated_rows(reference, one, ref_logits[b:b + 1], int(n),
                                      config.n_generated, config.length, sampling, key)
            rows += list(gen_rows)
            kinds += ["generated"] * config.n_generated
            holdout.append(_holdout_rows(config.n_generated, config.holdout, rng))
        if config.n_repeat:
            rows += repeat_rows(ctx, config.n_repeat, config.length)
            kinds += ["repeat"] * config.n_repeat
            holdout.append(_holdout_rows(config.n_repeat, config.holdout, rng))
        if config.n_reply:
            key = jax.random.fold_in(jax.random.key(config.seed + 1), b)
            rows += list(reply_rows(reference, one, int(n), config.reply_prefix,
                                    config.n_reply, config.length, sampling, key))
            kinds += ["reply"] * config.n_reply
            holdout.append(_holdout_rows(config.n_reply, config.holdout, rng))
        if config.n_text:
            rows += text_rows(text, config.n_text, config.length, text_rng)
            kinds += ["text"] * config.n_text
            holdout.append(_holdout_rows(config.n_text, config.holdout, text_rng))
        ctx_of += [b] * config.n_rows
    row_lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.zeros((len(rows), config.length), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    return ProbeSet(tokens, row_lengths, np.array(ctx_of, np.int32), np.array(kinds),
                    np.concatenate(holdout))


def reference_model(model: Model) -> Model:
    """The same params with full-precision dense caches (window rings for sliding layers)."""
    return model.replace(caches=default_caches(model.config, "float32"))


class ReferencePass(NamedTuple):
    """The probe rows run through the full-cache reference, layer by layer."""

    hidden: tuple  # L+1 hidden states [P, m, D]: entering each layer, then the output
    captures: tuple  # L dicts {"q", "k", "v", "attn"} of the probe rows


class ProbedContext(NamedTuple):
    """Everything about a context that does not depend on how its cache is compressed:
    fit it once, then fit patches (or baselines) for any number of compressions.

    It is also calibration data: every PatchKV-family transform (`patchkv`, `grkv`, `am`)
    calibrates on it as on the context's CalibrationData, without rebuilding the probes
    (research/transforms.py, per-context transforms)."""

    tokens: np.ndarray  # [B, T] contexts, right-padded
    lengths: np.ndarray  # [B]
    probes: ProbeSet
    ref_states: tuple  # reference cache states of the contexts
    reference: ReferencePass
    max_len: int  # cache slots the context + one probe row need
    seconds: float  # wall time of reference prefill + probes + reference pass
    config: ProbeConfig | None = None  # how the probes were built


def reference_pass(reference: Model, ref_states: tuple, probes: ProbeSet,
                   lengths: np.ndarray) -> ReferencePass:
    start = jnp.asarray(np.asarray(lengths)[probes.context], jnp.int32)
    n_new = jnp.asarray(probes.lengths, jnp.int32)
    x = layerwise.embed(reference, probes.tokens)
    hidden, captures = [x], []
    for layer in range(reference.config.n_layers):
        x, cap = layerwise.run_layer_rows(layerwise.layer_view(reference, layer), x, start,
                                          n_new, ref_states[layer], probes.context)
        hidden.append(x)
        captures.append({k: cap[k] for k in ("q", "k", "v", "attn")})
    return ReferencePass(tuple(hidden), tuple(captures))


def probe_context(model: Model, contexts: CalibrationData,
                  config: ProbeConfig = ProbeConfig(),
                  text: np.ndarray | None = None) -> ProbedContext:
    """Prefill `contexts` in the full-precision reference of `model`, build probe rows and
    run them through the reference (the half of a patch fit shared by every compression).

    text: 1-D token ids the text rows are drawn from (needed when config.n_text > 0);
      keep it apart from the evaluation text (the experiments pass the calibration split).
    """
    import time
    if contexts is None:
        raise ValueError("patchkv needs the context as calibration data "
                         "(CalibrationData of the context tokens); got None")
    if not isinstance(contexts, CalibrationData):
        raise TypeError(f"contexts must be CalibrationData, got {type(contexts).__name__}")
    contexts.validate()
    text = _check_text(text, config, model.config.vocab_size)
    t0 = time.perf_counter()
    tokens, lengths = np.asarray(contexts.tokens), np.asarray(contexts.lengths)
    ref = reference_model(model)
    max_len = int(lengths.max()) + config.length
    ref_logits, ref_states = prefill_batch(ref, tokens, lengths, max_len)
    probes = build_probes(ref, tokens, lengths, ref_states, ref_logits, config, text)
    ref_pass = reference_pass(ref, ref_states, probes, lengths)
    jax.block_until_ready(ref_pass)
    return ProbedContext(tokens, lengths, probes, ref_states, ref_pass, max_len,
                         time.perf_counter() - t0, config)


def as_probed(model: Model, data, config: ProbeConfig,
              text: np.ndarray | None = None) -> ProbedContext:
    """A per-context transform's calibration data as a ProbedContext: a ProbedContext as
    it is (it must have been built with `config`), a CalibrationData of the context probed
    here (`probe_context(model, data, config, text)`)."""
    if isinstance(data, ProbedContext):
        if data.config is not None and data.config != config:
            raise ValueError(f"the ProbedContext was built with {data.config}, the "
                             f"transform asks for probes={config}")
        return data
    return probe_context(model, data, config, text)


def _check_text(text, config: ProbeConfig, vocab_size: int) -> np.ndarray | None:
    if not config.n_text:
        return None
    if text is None:
        raise ValueError(f"ProbeConfig.n_text={config.n_text} needs a text pool: pass "
                         f"probe_context(..., text=<1-D token ids>)")
    text = np.asarray(text)
    if text.ndim != 1 or not np.issubdtype(text.dtype, np.integer):
        raise ValueError(f"text must be 1-D integer token ids, got shape {text.shape} "
                         f"dtype {text.dtype}")
    if text.size and not 0 <= text.min() <= text.max() < vocab_size:
        raise ValueError(f"text token ids must be in [0, {vocab_size}), got "
                         f"[{text.min()}, {text.max()}]")
    return text.astype(np.int32)
