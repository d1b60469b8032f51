"""Evaluation tasks and the one-context session helpers (no real model needed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import forward, init_params, make_model, tiny_config
from research.patchkv import session, tasks


class CharTokenizer:
    """Stand-in tokenizer: one id per character, chat template like SmolLM2's."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages):
        body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return "<|im_start|>system\nYou are helpful.<|im_end|>\n" + body + \
            "<|im_start|>assistant\n"


def test_continuation_tasks_layout():
    ids = np.arange(10_000)
    out = tasks.continuation_tasks(ids, n_contexts=3, context_len=100, n_continuations=4,
                                   continuation_len=10)
    assert len(out) == 3
    for t in out:
        assert t.context.shape == (100,) and t.continuations.shape == (4, 10)
        np.testing.assert_array_equal(t.continuations[0], t.context[-1] + 1 + np.arange(10))
        start, end = t.window  # ids are positions here, so the window is checkable
        np.testing.assert_array_equal(np.concatenate([t.context, t.continuations.ravel()]),
                                      np.arange(start, end))
    dev = tasks.continuation_tasks(ids, n_contexts=1, context_len=100, n_continuations=4,
                                   continuation_len=10, offset=5000)
    np.testing.assert_array_equal(dev[0].context, 5000 + np.arange(100))
    assert dev[0].window == (5000, 5140)
    with pytest.raises(ValueError, match="offset"):
        tasks.continuation_tasks(ids, n_contexts=1, context_len=100, n_continuations=1,
                                 continuation_len=10, offset=-1)
    with pytest.raises(ValueError, match="need"):
        tasks.continuation_tasks(ids[:100], n_contexts=2, context_len=100, n_continuations=1,
                                 continuation_len=10)
    with pytest.raises(ValueError, match=">= 1"):
        tasks.continuation_tasks(ids, n_contexts=0, context_len=100, n_continuations=1,
                                 continuation_len=10)


def test_retrieval_task_places_every_fact_once_and_is_query_agnostic():
    tok = CharTokenizer()
    filler = tok.encode("lorem ipsum dolor sit amet " * 400)
    t = tasks.retrieval_task(tok, filler, n_facts=4, context_len=1500, seed=1)
    text = tok.decode(t.context)
    assert text.startswith("<|im_start|>system") and "<|im_start|>user\n" in text
    assert "<|im_end|>" not in text.split("<|im_start|>user\n")[1]  # the turn stays open
    for q, a in zip(t.questions, t.answers):
        name = tok.decode(q).split("access code for ")[1].split("?")[0]
        assert text.count(f"The access code for {name} is {a}.") == 1
        assert tok.decode(q).endswith(f"The access code for {name} is")
    assert len(set(t.answers)) == 4
    assert tasks.exact_match(" 4821.", "4821") and not tasks.exact_match(" 48210", "4821")
    assert not tasks.exact_match("no idea", "4821")
    with pytest.raises(ValueError, match="too short"):
        tasks.retrieval_task(tok, filler, n_facts=4, context_len=150, seed=0)
    with pytest.raises(ValueError, match="n_facts"):
        tasks.retrieval_task(tok, filler, n_facts=0, context_len=1500, seed=0)


@pytest.fixture(scope="module")
def tiny_model():
    config = tiny_config()
    return make_model(config, init_params(config, jax.random.key(0)))


def test_reply_prefix_closes_the_user_turn_and_opens_the_assistant():
    tok = CharTokenizer()
    assert tok.decode(tasks.reply_prefix(tok)) == "<|im_end|>\n<|im_start|>assistant\n"


def test_session_scores_match_a_single_full_forward(tiny_model):
    """Context prefilled once + continuation as a query == one forward over both."""
    rng = np.random.default_rng(0)
    context = rng.integers(0, 97, 40)
    conts = rng.integers(0, 97, (2, 9))
    ctx = session.prefill_context(tiny_model, context, 64)
    got = session.score_continuations(tiny_model, ctx, conts)
    seqs = jnp.asarray(np.concatenate([np.tile(context, (2, 1)), conts], 1), jnp.int32)
    logp = np.asarray(jax.nn.log_softmax(jax.jit(forward)(tiny_model, seqs).logits, -1))
    for i in range(2):
        nll = -np.mean([logp[i, 40 + j, conts[i][j + 1]] for j in range(8)])
        np.testing.assert_allclose(got.per_row_nll[i], nll, rtol=1e-5)
    assert got.n_tokens == 16
    answers = session.answer_queries(tiny_model, ctx, [[1, 2, 3], [4]], max_new_tokens=3)
    assert [len(a) for a in answers] == [3, 3]


def test_session_bad_input(tiny_model):
    with pytest.raises(ValueError, match="non-empty"):
        session.prefill_context(tiny_model, [], 16)
    with pytest.raises(ValueError, match="exceeds"):
        session.prefill_context(tiny_model, list(range(20)), 16)
    ctx = session.prefill_context(tiny_model, [1, 2, 3], 16)
    with pytest.raises(ValueError, match="continuations"):
        session.score_continuations(tiny_model, ctx, np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="at least one"):
        session.answer_queries(tiny_model, ctx, [], max_new_tokens=2)
