"""Engine scoring (prompt logprobs through the scheduler and prefix cache), per-token
logprobs and logit processors (penalties, logit_bias), on a tiny random model with f32 KV:
every number is checked against a plain dense forward of the same tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import init_params, make_model, tiny_config
from research.model.llama import forward
from research.serving.api import MAX_LOGPROBS, Request, RequestError, SamplingParams
from research.serving.engine import ServingEngine
from research.decode.sampling import process_logits
from tests.serving.test_engine import CharTokenizer

TOK = CharTokenizer()
BLOCK = 8


@pytest.fixture(scope="module")
def model():
    config = tiny_config(vocab_size=128, max_position=256)
    return make_model(config, init_params(config, jax.random.key(3)))


@pytest.fixture(scope="module")
def engine(model):
    return ServingEngine(model, TOK, n_blocks=64, block_size=BLOCK, max_batch=4, max_len=128,
                         token_budget=48, prefill_chunk=16, max_queue=16, min_read_len=32)


def _run(engine, requests):
    for r in requests:
        engine.add_request(r)
    events = []
    for _ in range(2000):
        if not engine.has_work():
            break
        events += engine.step()
    return events


def _dense_logprobs(model, ids):
    """[n, V] log-softmax of a plain forward over `ids` (row t predicts token t + 1)."""
    logits = forward(model, jnp.asarray([ids], jnp.int32), logits="all").logits[0]
    return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def _score(engine, rid, ids, **kw):
    params = SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 0), prompt_logprobs=5,
                            **kw)
    events = _run(engine, [Request(rid, tuple(ids), params)])
    mine = [e for e in events if e.request_id == rid]
    assert mine[-1].finish_reason is not None
    return mine


def test_prompt_logprobs_equal_a_dense_forward_and_reuse_the_prefix_cache(engine, model):
    shots = "the cat sat on the mat. the dog sat on the log. " * 2  # 98 chars, > 1 block
    ids_a = TOK.encode(shots + "the bird sat")
    ids_b = TOK.encode(shots + "a fish swam")
    for rid, ids in (("a", ids_a), ("b", ids_b)):
        events = _score(engine, rid, ids)
        assert len(events) == 1 and events[0].finish_reason == "length"
        assert events[0].token_id is None
        pl = events[0].prompt_logprobs
        assert pl.token_ids == tuple(ids)
        ref = _dense_logprobs(model, ids)
        want = ref[np.arange(len(ids) - 1), ids[1:]]
        assert np.isnan(pl.token_logprobs[0])
        np.testing.assert_allclose(pl.token_logprobs[1:], want, atol=1e-4)
        top = np.argsort(-ref, axis=-1)[:, :MAX_LOGPROBS]
        np.testing.assert_array_equal(pl.top_ids[1:, :3], top[:-1, :3])
        np.testing.assert_allclose(pl.top_logprobs[1:],
                                   np.take_along_axis(ref, top, -1)[:-1], atol=1e-4)
    # b shares a's few-shot prefix: its full blocks (less one token) came from the cache
    shared = len(shots) // BLOCK * BLOCK
    assert events[0].n_cached_prompt_tokens == shared - 1
    assert engine.metrics().kv_blocks_used == 0


def test_scoring_with_one_token_and_generated_logprobs(engine, model):
    ids = TOK.encode("abcabcabc")
    events = _score(engine, "c", ids, max_new_tokens=3, logprobs=2)
    ref = _dense_logprobs(model, ids)
    first = events[0]
    assert first.prompt_logprobs is not None
    assert all(e.prompt_logprobs is None for e in events[1:])
    tok = first.token_id if first.token_id is not None else first.stop_token_id
    assert tok == int(np.argmax(ref[-1]))  # greedy
    np.testing.assert_allclose(first.logprob, ref[-1, tok], atol=1e-4)
    assert [t for t, _ in first.top_logprobs[:2]] == list(np.argsort(-ref[-1])[:2])
    # every later token's logprob is the dense forward's over the whole sequence
    toks = [e.token_id for e in events if e.token_id is not None]
    full = _dense_logprobs(model, ids + toks)
    for k, e in enumerate(e for e in events if e.token_id is not None):
        np.testing.assert_allclose(e.logprob, full[len(ids) - 1 + k, e.token_id], atol=1e-4)


def test_a_stop_token_is_reported_with_its_logprob(model):
    ids = TOK.encode("xyz")
    ref = _dense_logprobs(model, ids)
    stop = int(np.argmax(ref[-1]))
    eng = ServingEngine(model, TOK, n_blocks=32, block_size=BLOCK, max_batch=2, max_len=64,
                        token_budget=32, prefill_chunk=16, stop_token_ids=[stop],
                        min_read_len=32)
    events = _run(eng, [Request("s", tuple(ids), SamplingParams(max_new_tokens=1,
                                                                logprobs=0))])
    assert [(e.token_id, e.stop_token_id, e.finish_reason) for e in events] == [
        (None, stop, "stop")]
    np.testing.assert_allclose(events[0].logprob, ref[-1, stop], atol=1e-4)


def test_logit_bias_and_penalties_steer_greedy_tokens(engine, model):
    ids = TOK.encode("hello there")
    base = [e.token_id for e in _run(engine, [Request("p0", tuple(ids),
                                                      SamplingParams(max_new_tokens=6))])]
    forced = _run(engine, [Request("p1", tuple(ids), SamplingParams(
        max_new_tokens=6, logit_bias=((ord("q"), 100.0),)))])
    assert [e.token_id for e in forced] == [ord("q")] * 6
    # a huge frequency penalty forbids repeating a generated token
    pen = _run(engine, [Request("p2", tuple(ids), SamplingParams(
        max_new_tokens=8, frequency_penalty=2.0, logit_bias=((ord("q"), 3.0),)))])
    toks = [e.token_id for e in pen if e.token_id is not None]
    assert toks[0] == ord("q") and toks.count(ord("q")) <= 3
    # mixed in one batch with plain requests, the plain one is unchanged
    both = _run(engine, [Request("p3", tuple(ids), SamplingParams(max_new_tokens=6)),
                         Request("p4", tuple(ids), SamplingParams(
                             max_new_tokens=6, presence_penalty=1.5, repetition_penalty=1.3))])
    assert [e.token_id for e in both if e.request_id == "p3"] == base
    assert engine.metrics().kv_blocks_used == 0


def test_process_logits_matches_its_definition():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6)).astype(np.float32)
    counts = np.array([[0, 2, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], np.float32)
    seen = counts > 0
    seen[1, 5] = True
    bias = np.zeros((2, 6), np.float32)
    bias[1, 0] = -3
    out = np.asarray(process_logits(logits, counts, seen, bias, np.array([0.5, 0.0]),
                                    np.array([0.25, 0.0]), np.array([1.0, 2.0])))
    want = logits.copy()
    want[0] -= 0.25 * counts[0] + 0.5 * (counts[0] > 0)
    x = logits[1, 5]
    want[1, 5] = x / 2 if x > 0 else x * 2
    want[1, 0] -= 3
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_bad_scoring_params_name_the_field(engine):
    for kw, field in ((dict(max_new_tokens=0), "max_tokens"),
                      (dict(logprobs=21), "logprobs"),
                      (dict(prompt_logprobs=-1), "prompt_logprobs"),
                      (dict(presence_penalty=3.0), "presence_penalty"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"),
                      (dict(logit_bias=((1, 200.0),)), "logit_bias")):
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.field == field
    with pytest.raises(RequestError) as e:
        engine.add_request(Request("x", (1, 2), SamplingParams(logit_bias=((999, 1.0),))))
    assert e.value.field == "logit_bias"
