"""Passkey trials: a pure function of their seed, the key hidden where the depth says,
prompts of the stated length, filler from the given text only; the scorer's greedy
continuation equals a plain argmax loop over full forwards."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research import data
from research.eval.passkey import (ANSWER_PREFIX, HEAD, LENGTH_TOLERANCE, NEEDLE, QUESTION,
                                   first_number, passkey_accuracy, passkey_trials)
from research.model import forward, init_params, make_model, tiny_config


@pytest.fixture(scope="module")
def tok():
    from experiments.common import tokenizer_only
    return tokenizer_only(None)


def _filler_of(trial) -> str:
    """The prompt with the fixed text taken out: the filler, whitespace-normalized."""
    text = trial.prompt
    for part in (HEAD, NEEDLE.format(key=trial.key), QUESTION, ANSWER_PREFIX):
        text = text.replace(part, " ")
    return " ".join(text.split())


def test_the_passkey_generator_is_deterministic_per_seed(tok):
    filler = data.corpus_text("dev")
    a = passkey_trials(tok, 300, 5, seed=7, filler=filler)
    assert a == passkey_trials(tok, 300, 5, seed=7, filler=filler)
    b = passkey_trials(tok, 300, 5, seed=8, filler=filler)
    assert [t.key for t in a] != [t.key for t in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, b))


@pytest.mark.parametrize("template", ["plain", "chat"])
def test_depths_lengths_and_the_key(tok, template):
    n, length = 6, 400
    trials = passkey_trials(tok, length, n, seed=3, filler=data.corpus_text("dev"),
                            template=template)
    assert [t.depth for t in trials] == pytest.approx(np.linspace(0, 1, n))
    for t in trials:
        assert length - LENGTH_TOLERANCE <= len(t.ids) <= length
        assert list(t.ids) == tok.encode(t.prompt)
        assert re.fullmatch(r"[1-9]\d{4}", t.key)
        assert t.prompt.count(t.key) == 2 and t.prompt.count(NEEDLE.format(key=t.key)) == 1
        assert t.prompt.rstrip().endswith(ANSWER_PREFIX)
    first, last = trials[0].prompt, trials[-1].prompt
    assert f"{HEAD} {NEEDLE.format(key=trials[0].key)}" in first  # depth 0: no filler before
    assert f"{NEEDLE.format(key=trials[-1].key)} {QUESTION}" in last  # depth 1: none after
    middle = trials[n // 2].prompt
    pos = middle.index(NEEDLE.format(key=trials[n // 2].key))
    assert 0.3 < (pos - len(HEAD)) / len(middle) < 0.7


@pytest.mark.parametrize("split", ["dev", "test"])
def test_the_filler_comes_from_the_given_text_only(tok, split):
    """Dev trials read the dev half, test trials the fresh test text: every filler word
    run of a trial is a run of its own text (read cyclically) and not of the other."""
    texts = {"dev": data.corpus_text("dev"), "test": data.split_text("test", "stdlib")}
    own = " ".join(texts[split].split())
    other = " ".join(texts["dev" if split == "test" else "test"].split())
    for t in passkey_trials(tok, 256, 4, seed=1, filler=texts[split]):
        words = _filler_of(t).split()
        runs = [" ".join(words[i:i + 12]) for i in range(0, len(words) - 12, 12)]
        assert runs and all(r in own + " " + own for r in runs)
        assert not any(r in other for r in runs)


def test_bad_arguments(tok):
    filler = data.corpus_text("dev")
    with pytest.raises(ValueError, match="n_trials"):
        passkey_trials(tok, 300, 0, 0, filler)
    with pytest.raises(ValueError, match="template"):
        passkey_trials(tok, 300, 2, 0, filler, template="llama")
    with pytest.raises(ValueError, match="length"):
        passkey_trials(tok, 40, 2, 0, filler)
    with pytest.raises(ValueError, match="filler"):
        passkey_trials(tok, 300, 2, 0, "too short")


def test_first_number_reads_the_answer_line():
    assert first_number(" 71432. Remember it.") == "71432"
    assert first_number(" is 12 and 71432") == "12"
    assert first_number(" none here\n71432") is None
    assert first_number("") is None


def test_the_scorer_decodes_greedily(tok, caplog):
    """Generations equal an argmax loop over one full forward per token (no cache), for
    trials batched with padding to one cache shape; `correct` is the parsed answer == key;
    progress is logged after each batch, counting the real trials, not the padding."""
    config = tiny_config(vocab_size=tok.vocab_size, max_position=512, dim=64, ffn_dim=128)
    model = make_model(config, init_params(config, jax.random.key(4)))
    trials = passkey_trials(tok, 160, 3, seed=2, filler=data.corpus_text("dev"))
    caplog.set_level(logging.INFO, logger="servax.passkey")
    got = passkey_accuracy(model, tok, trials, max_new_tokens=3, batch_size=2,
                           prefill_chunk=64, label="tiny@160")
    progress = [r.getMessage() for r in caplog.records if r.name == "servax.passkey"]
    assert [m.split(":")[0] for m in progress] == ["passkey tiny@160"] * 2
    assert [m.split(": ")[1].split(",")[0] for m in progress] == ["2 trials done",
                                                                   "3 trials done"]
    assert f"{sum(got.correct)} keys found" in progress[-1]
    fwd = jax.jit(lambda ids: forward(model, ids).logits[0, -1])
    for t, generation in zip(trials, got.generations):
        ids = list(t.ids)
        for _ in range(3):
            ids.append(int(jnp.argmax(fwd(jnp.asarray([ids], jnp.int32)))))
        assert generation == tok.decode(ids[len(t.ids):], skip_special=True)
    assert got.answers == tuple(first_number(g) for g in got.generations)
    assert got.correct == tuple(a == t.key for a, t in zip(got.answers, trials))
    assert got.accuracy == sum(got.correct) / 3
    with pytest.raises(ValueError, match="max_position"):
        passkey_accuracy(model, tok, passkey_trials(tok, 600, 1, 0, data.corpus_text("dev")))
