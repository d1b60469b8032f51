"""The serving engine on a tiny random model with a TaSQ 1-bit KV cache (codes in pages):
continuous batching equals TaSQ's dense `generate`,
seeds, stop strings, preemption, prefix cache, speculative decoding, no recompiles, no
leaked blocks, bad input. (The real SmolLM2 checks are in test_engine_smollm2.py.)"""
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import init_params, make_model, tiny_config
from research.kv.block_allocator import OutOfBlocksError
from research.serving.api import QueueFullError, Request, RequestError, SamplingParams
from research.serving.engine import ServingEngine, TextStream, prompt_lookup_draft
from research.decode.generate import generate
from research.tasq import TaSQConfig, tasq
from research.tasq import CQCodec, VQCodec
from research.transforms import CalibrationData, calibrate_and_apply
from research.decode.sampling import (SamplingConfig, filter_logits, filter_logits_per_row,
                                       sample_per_row)


class CharTokenizer:
    eos_id = 4

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(i) for i in ids if not (skip_special and i == self.eos_id))

    def token_to_id(self, token):
        return None


class ByteTokenizer:
    """Token = one UTF-8 byte: a multi-byte character spans several tokens."""

    def decode(self, ids, skip_special=False):
        return bytes(ids).decode("utf-8", errors="replace")


TOK = CharTokenizer()
PROMPTS = ["hello world, this is a test", "abc", "the quick brown fox jumps over the",
           "zz", "a b a b a b a b", "serving engines batch continuously"]


@pytest.fixture(scope="module")
def model():
    """A tiny random model with a TaSQ 1-bit KV cache: every test below serves TaSQ codes
    in pages and compares with TaSQ's dense-cache `generate` (f32 is covered by the
    SmolLM2 test)."""
    config = tiny_config(vocab_size=128, max_position=256, head_dim=16, n_heads=4,
                         n_kv_heads=2)
    params = init_params(config, jax.random.key(3))
    params["embed"] = params["embed"] * 0.15  # varied, non-degenerate samples
    ids = np.random.default_rng(0).integers(32, 127, 4 * 64)
    cfg = TaSQConfig(bits=1, kmeans_iters=3, max_points=256, share_codebooks=True)
    quantized, _ = calibrate_and_apply(tasq(cfg), make_model(config, params),
                                       CalibrationData.from_ids(ids, 64, 4))
    # TaSQ's default key space (pre-RoPE, chosen on dev) codes keys with the CQ-style codec
    assert isinstance(quantized.caches[0].codec, (CQCodec, VQCodec))
    return quantized


def _engine(model, **kw):
    args = dict(n_blocks=64, block_size=8, max_batch=4, max_len=64, token_budget=24,
                prefill_chunk=16, stop_token_ids=(), max_queue=8)
    args.update(kw)
    return ServingEngine(model, TOK, **args)


@pytest.fixture(scope="module")
def engine(model):
    """One engine for every test (warm-up compiles dominate): a tight pool of 10 blocks
    of 8 (one 64-token request fits, concurrent ones get preempted), prefix cache on,
    greedy requests decode speculatively with 3 prompt-lookup drafts."""
    return _engine(model, n_blocks=10, speculative=3)


def _run(engine, requests, arrive_every=0, abort_at=None, max_steps=2000):
    """Feed `requests` (one per `arrive_every` steps), step until idle; events by id."""
    out, pending, steps = {}, list(requests), 0
    abort_at = abort_at or {}
    while pending or engine.has_work():
        if pending and (arrive_every == 0 or steps % arrive_every == 0):
            for r in (pending if arrive_every == 0 else pending[:1]):
                engine.add_request(r)
            pending = [] if arrive_every == 0 else pending[1:]
        for rid in abort_at.get(steps, ()):
            engine.abort(rid)
        for e in engine.step():
            out.setdefault(e.request_id, []).append(e)
        steps += 1
        assert steps < max_steps
    return out


def _reference(model, prompts, n):
    """`generate` greedy, n <= 24 tokens per prompt, always one compiled shape: the batch
    is padded to 8 rows with a 48-token row (rows are independent) and the first n of 24
    greedy tokens are the n-token greedy output."""
    prompts = [list(p) for p in prompts]
    assert len(prompts) <= 7 and n <= 24
    rows = prompts + [[120] * 48] * (8 - len(prompts))
    out = generate(model, rows, max_new_tokens=24, max_len=80).tokens
    return [o[:n] for o in out[:len(prompts)]]


def _tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def _check_stream(events):
    """Exactly one finish event, last; text increments concatenate to the output."""
    assert [e.finish_reason is not None for e in events].count(True) == 1
    assert events[-1].finish_reason is not None
    return "".join(e.text for e in events)


def _greedy(n, prompts=PROMPTS):
    return [Request(f"g{i}", tuple(TOK.encode(p)), SamplingParams(max_new_tokens=n))
            for i, p in enumerate(prompts)]


def test_staggered_continuous_batching_equals_generate(engine, model):
    reqs = _greedy(12)
    out = _run(engine, reqs, arrive_every=2)  # 6 requests, 4 slots, staggered arrivals
    want = _reference(model, [r.prompt_ids for r in reqs], 12)
    for r, w in zip(reqs, want):
        assert _tokens(out[r.request_id]) == w
        assert _check_stream(out[r.request_id]) == TOK.decode(w)
        assert out[r.request_id][-1].finish_reason == "length"
        assert out[r.request_id][0].n_prompt_tokens == len(r.prompt_ids)
    assert engine.metrics().kv_blocks_used == 0


def test_preemption_by_recompute_gives_the_same_tokens(engine, model):
    # 24-token prompts (4 blocks each with the first token): two are admitted into the 10
    # blocks, and growing to 44 tokens (6 blocks each) while decoding they run out
    prompts = [(p * 12)[:24] for p in PROMPTS[:4]]
    reqs = _greedy(20, prompts)
    before = engine.metrics().preemptions
    out = _run(engine, reqs)
    assert engine.metrics().preemptions > before
    want = _reference(model, [r.prompt_ids for r in reqs], 20)
    for r, w in zip(reqs, want):
        assert _tokens(out[r.request_id]) == w
    assert engine.spec_stats.drafted > 0  # greedy requests decoded speculatively
    assert engine.metrics().kv_blocks_used == 0


def test_speculative_decoding_accepts_drafts_and_matches_generate(engine, model):
    prompt = TOK.encode("ab ab ab ab ab ab ab ab ab ab")
    before = engine.spec_stats.accepted
    out = _run(engine, [Request("s", tuple(prompt), SamplingParams(max_new_tokens=24))])
    want = _reference(model, [prompt], 24)[0]
    assert _tokens(out["s"]) == want
    assert engine.spec_stats.accepted > before


def test_same_seed_same_tokens_whatever_the_batch(engine):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7, max_new_tokens=16)
    probe = Request("probe", tuple(TOK.encode("sampling probe")), params)
    alone = _tokens(_run(engine, [probe])["probe"])
    others = [Request(f"o{i}", tuple(TOK.encode(p)),
                      SamplingParams(temperature=1.0, seed=i, max_new_tokens=10))
              for i, p in enumerate(PROMPTS[:5])]
    crowd = _run(engine, others[:2] + [probe] + others[2:], arrive_every=1)
    assert _tokens(crowd["probe"]) == alone
    other_seed = Request("probe", probe.prompt_ids,
                         SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=8,
                                        max_new_tokens=16))
    assert _tokens(_run(engine, [other_seed])["probe"]) != alone


def test_stop_strings_and_stop_ids(engine):
    prompt = tuple(TOK.encode("stop strings"))
    free = _tokens(_run(engine, [Request("f", prompt, SamplingParams(max_new_tokens=16))])["f"])
    text = TOK.decode(free)
    stop = text[6:8]
    cut = text.find(stop)
    out = _run(engine, [Request("s", prompt, SamplingParams(max_new_tokens=16, stop=(stop,)))])
    assert _check_stream(out["s"]) == text[:cut]
    assert out["s"][-1].finish_reason == "stop"
    sid = free[5]
    out = _run(engine, [Request("t", prompt, SamplingParams(max_new_tokens=16,
                                                            stop_token_ids=(sid,)))])
    assert _tokens(out["t"]) == free[:free.index(sid)]
    assert out["t"][-1].finish_reason == "stop" and out["t"][-1].token_id is None


def test_prefix_cache_hits_give_identical_outputs(engine, model):
    shared = "a shared system prompt spanning 5 blocks"  # 40 tokens
    prompts = [shared + "one", shared + "two", shared + "one"]
    reqs = _greedy(8, prompts)
    hits0 = engine.metrics().prefix_cache_hits
    out = _run(engine, reqs, arrive_every=8)  # sequential: later ones find the blocks
    want = _reference(model, [r.prompt_ids for r in reqs], 8)
    for r, w in zip(reqs, want):
        assert _tokens(out[r.request_id]) == w
    assert engine.metrics().prefix_cache_hits > hits0
    assert out[reqs[2].request_id][0].n_cached_prompt_tokens >= 40


def test_maxengine_primitives(engine, model):
    prompt = tuple(TOK.encode("prefill insert generate"))
    prefix = engine.prefill(Request("p", prompt, SamplingParams(max_new_tokens=6)))
    engine.insert(prefix, 3)
    got = [prefix.first_token]
    state = engine.state
    while "p" in state.slots:
        state, toks = engine.generate(state)
        got += toks[3]
    assert got == _reference(model, [prompt], 6)[0]
    events = engine.drain_events()
    assert _tokens(events) == got and events[-1].finish_reason == "length"


def test_random_load_no_recompiles_no_leaks(engine):
    rng = random.Random(0)
    compiles0 = engine.metrics().compiles
    mixed0 = engine.step_stats.mixed_steps
    reqs = []
    for i in range(14):
        text = "".join(rng.choice("abcde ") for _ in range(rng.randint(1, 40)))
        temp = rng.choice([0.0, 0.7])
        reqs.append(Request(f"x{i}", tuple(TOK.encode(text)), SamplingParams(
            temperature=temp, top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8]),
            seed=i, max_new_tokens=rng.randint(1, 20), stop=rng.choice([(), ("e",)]))))
    aborts = {3: ["x1"], 7: ["x4", "x5"], 12: ["x9"], 30: ["nonexistent"]}
    out = _run(engine, reqs, arrive_every=1, abort_at=aborts)
    assert set(out) == {r.request_id for r in reqs}
    for rid, events in out.items():
        _check_stream(events)
    assert out["x1"][-1].finish_reason == "abort"
    m = engine.metrics()
    assert m.compiles == compiles0  # nothing compiled while serving
    # every step kept its token budget; prefill chunks ran beside decode batches
    assert engine.step_stats.max_step_tokens <= engine.token_budget
    assert engine.step_stats.mixed_steps > mixed0
    assert m.kv_blocks_used == 0 and m.running == 0 and m.queue_length == 0
    engine.pool.prefix_cache.clear()
    engine.pool.allocator.check_consistency()
    assert engine.pool.allocator.n_used == 0  # nothing leaked


def test_bad_requests_name_the_field(engine):
    def field(**kw):
        args = dict(request_id="b", prompt_ids=(65, 66), params=SamplingParams())
        args.update(kw)
        with pytest.raises(RequestError) as e:
            engine.add_request(Request(**args))
        return e.value.field

    assert field(prompt_ids=tuple([65] * 64)) == "prompt"  # > max_len - 1
    assert field(prompt_ids=()) == "prompt"
    assert field(prompt_ids=(65, 999)) == "prompt"
    assert field(params=SamplingParams(max_new_tokens=63)) == "max_tokens"
    assert field(params=SamplingParams(max_new_tokens=4, stop=("",))) == "stop"
    assert field(params=SamplingParams(max_new_tokens=4, stop_token_ids=(128,))) == "stop_token_ids"
    assert field(request_id="") == "request_id"
    assert field(params=SamplingParams(max_new_tokens=4, top_k=129)) == "top_k"  # > vocab
    assert field(params=SamplingParams(max_new_tokens=4, top_k=2**31)) == "top_k"  # int32
    for name, kw in (("temperature", dict(temperature=-1.0)), ("top_p", dict(top_p=0.0)),
                     ("top_k", dict(top_k=-2)), ("max_tokens", dict(max_new_tokens=0))):
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.field == name
    for i in range(8):
        engine.add_request(Request(f"q{i}", (65,), SamplingParams(max_new_tokens=4)))
    with pytest.raises(RequestError, match="request_id"):
        engine.add_request(Request("q0", (65,), SamplingParams(max_new_tokens=4)))
    with pytest.raises(QueueFullError):
        engine.add_request(Request("q8", (65,), SamplingParams(max_new_tokens=4)))
    for i in range(8):
        engine.abort(f"q{i}")
    events = engine.step()
    assert sorted(e.request_id for e in events) == [f"q{i}" for i in range(8)]
    assert all(e.finish_reason == "abort" for e in events) and not engine.has_work()


def _fail_at(monkeypatch, seed: int, position: int):
    """Make the PRNG key of `seed`'s token at `position` raise (a row that cannot be
    built inside a step: position 0 is what add_request's trial build uses)."""
    import research.serving.engine as engine_mod
    real = engine_mod.token_key

    def key(s, pos):
        if s == seed and pos == position:
            raise OverflowError(f"injected: seed {s} position {pos}")
        return real(s, pos)

    monkeypatch.setattr(engine_mod, "token_key", key)


def _serve(engine, requests):
    for r in requests:
        engine.add_request(r)
    events = []
    while engine.has_work():
        events += engine.step()
    return events


@pytest.mark.parametrize("position,processed", [(0, False), (5, False), (7, True)])
def test_a_request_failing_in_a_step_fails_alone(engine, monkeypatch, position, processed):
    """A row that cannot be built (at add time: position 0; in its prefill: 5, the prompt
    length; in a later decode, through the logit-processor path: 7) fails its request
    only: the others' tokens are those of a run without it, and no block leaks."""
    sampled = dict(temperature=0.9, seed=11, max_new_tokens=6)
    good = [Request(f"g{i}", tuple(TOK.encode(p)), SamplingParams(**sampled))
            for i, p in enumerate(PROMPTS[:3])]
    want = {}
    for e in _serve(engine, good):
        want.setdefault(e.request_id, []).append(e.token_id)
    _fail_at(monkeypatch, 666, position)
    bias = ((65, 1.0),) if processed else ()
    bad = Request("bad", tuple(TOK.encode("hello")), SamplingParams(
        temperature=0.9, seed=666, max_new_tokens=6, logit_bias=bias))
    if position == 0:
        with pytest.raises(OverflowError, match="injected"):
            engine.add_request(bad)
        events = _serve(engine, good)
    else:
        events = _serve(engine, [good[0], bad] + good[1:])
        end = [e for e in events if e.request_id == "bad" and e.finish_reason]
        assert [(e.finish_reason, "injected" in e.error) for e in end] == [("error", True)]
    got = {}
    for e in events:
        if e.request_id != "bad":
            got.setdefault(e.request_id, []).append(e.token_id)
    assert got == want
    m = engine.metrics()
    assert m.kv_blocks_used == 0 and m.running == 0 and m.queue_length == 0
    engine.pool.prefix_cache.clear()
    engine.pool.allocator.check_consistency()
    assert engine.pool.allocator.n_used == 0


def test_engine_constructor_errors(model):
    with pytest.raises(ValueError, match="token_budget"):
        _engine(model, token_budget=2, warmup=False)
    with pytest.raises(ValueError, match="cannot hold"):
        _engine(model, n_blocks=4, warmup=False)


def test_text_stream_multibyte_and_stop_holdback():
    text = "héllo 世界 🎉 done"
    ids = list(text.encode("utf-8"))
    s = TextStream(ByteTokenizer())
    parts = [s.push(t)[0] for t in ids]
    assert "".join(parts) + s.flush() == text
    assert not any("\ufffd" in p for p in parts)
    s = TextStream(ByteTokenizer(), stops=("🎉 d",))
    out, stopped = "", False
    for t in ids:
        inc, stopped = s.push(t)
        out += inc
        if stopped:
            break
    assert stopped and out == "héllo 世界 "


def test_prompt_lookup_draft():
    assert prompt_lookup_draft([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert prompt_lookup_draft([5, 6, 7], 2) == []
    assert prompt_lookup_draft([1, 2, 1, 3, 1], 2) == [3, 1]  # latest earlier match


def test_per_row_sampling_matches_the_batch_filters():
    logits = jax.random.normal(jax.random.key(0), (2, 50)) * 3
    cfgs = [SamplingConfig(0.7, 5, 0.9), SamplingConfig(1.3, 0, 1.0)]
    got = jax.jit(filter_logits_per_row)(logits, jnp.array([c.temperature for c in cfgs]),
                                jnp.array([c.top_k for c in cfgs]),
                                jnp.array([c.top_p for c in cfgs]))
    for i, c in enumerate(cfgs):
        want = jax.jit(filter_logits, static_argnums=1)(logits[i:i + 1], c)[0]
        np.testing.assert_allclose(got[i], want, rtol=1e-6)
    keys = np.zeros((2, 2), np.uint32)
    toks = jax.jit(sample_per_row)(logits, jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2), keys)
    np.testing.assert_array_equal(toks, jnp.argmax(logits, -1))


@pytest.mark.slow  # ~30 s; qwix and TaSQ each serve in faster tests
@pytest.mark.filterwarnings("ignore::DeprecationWarning:qwix.*")  # qwix reads `.value`
def test_a_qwix_quantized_model_serves_with_its_tasq_cache(model):
    """Composition through public names: qwix int8 PTQ of the projections (through
    `NnxModel`) over the TaSQ-coded cache; the engine's outputs equal `generate`'s on the
    same quantized model, and differ from the unquantized model's somewhere."""
    import qwix
    from research.model import NnxModel
    from research.model.nnx_adapter import QwixLinear
    rule = qwix.QuantizationRule(module_path=r".*/(wq|wk|wv|wo|w_gate|w_up|w_down)",
                                 weight_qtype=jnp.int8)
    example = jnp.asarray([TOK.encode(PROMPTS[0])], jnp.int32)
    served = qwix.quantize_model(NnxModel(model), qwix.PtqProvider([rule]),
                                 example).to_model()
    assert isinstance(served.params["layers"][0]["wq"], QwixLinear)
    assert served.caches == model.caches
    reqs = _greedy(12, PROMPTS[:4])
    out = _run(_engine(served), reqs)
    want = _reference(served, [r.prompt_ids for r in reqs], 12)
    assert [_tokens(out[r.request_id]) for r in reqs] == want
    assert want != _reference(model, [r.prompt_ids for r in reqs], 12)


def test_a_burst_is_admitted_only_as_far_as_the_pool_holds_its_prompts(engine, model):
    """4 requests at once whose prompts need 4 of the pool's 10 blocks each: two start,
    the others wait in the queue (admitting all four made them preempt each other), and
    every one still finishes with generate's tokens."""
    prompts = [(p * 16)[:30] for p in PROMPTS[:4]]
    reqs = [Request(f"burst{i}", tuple(TOK.encode(p)), SamplingParams(max_new_tokens=4))
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    preempted0 = engine.metrics().preemptions
    out, peak = {}, 0
    while engine.has_work():
        for e in engine.step():
            out.setdefault(e.request_id, []).append(e)
        peak = max(peak, engine.metrics().running)
    assert peak == 2
    assert engine.metrics().preemptions == preempted0
    want = _reference(model, [r.prompt_ids for r in reqs], 4)
    assert [_tokens(out[r.request_id]) for r in reqs] == want
    assert engine.metrics().kv_blocks_used == 0


def test_unshare_gives_private_blocks_and_the_same_tokens(model):
    """Rows built from one prefilled prompt through the prefix cache share its blocks;
    `unshare` copies them (no block held by two rows after it) and every row still
    decodes the reference tokens."""
    eng = _engine(model, prefix_cache=True)
    prompt = tuple(TOK.encode("one prompt copied into three decode rows"))
    for i in range(3):
        eng.insert(eng.prefill(Request(f"u{i}", prompt, SamplingParams(max_new_tokens=5))), i)
    m = eng.pool.manager
    seqs = [r.seq for r in eng._live.values()]
    assert set(m.blocks(seqs[0])) & set(m.blocks(seqs[1]))  # shared through the cache
    n_blocks = len(m.blocks(seqs[1]))
    assert [eng.unshare(f"u{i}") for i in (1, 2)] == [n_blocks] * 2
    blocks = [set(m.blocks(r.seq)) for r in eng._live.values()]
    assert not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2])
    m.allocator.check_consistency()
    want = _reference(model, [prompt], 5)[0]
    state, got = eng.state, {i: [] for i in range(3)}
    while any(s is not None for s in state.slots):
        state, toks = eng.generate(state)
        for i in range(3):
            got[i] += toks[i]
    assert all(want[1:] == got[i] for i in range(3))
    with pytest.raises(ValueError, match="not a live request"):
        eng.unshare("u0")


def test_fork_copies_a_prefilled_request_without_a_forward(model):
    """`fork` gives a new request the source's tokens and private copies of its blocks
    with no forward pass (no KV slot is read); the forks decode the source's tokens, a
    fork made mid-decode continues where its source stands, their texts are whole, and
    bad forks are refused with nothing changed."""
    eng = _engine(model, prefix_cache=False, n_blocks=24)
    prompt = tuple(TOK.encode("one prompt forked into three decode rows"))
    src = eng.prefill(Request("f0", prompt, SamplingParams(max_new_tokens=6)))
    eng.insert(src, 0)
    events = {e.request_id: [e] for e in eng.drain_events()}
    reads = eng.step_stats.read_slots
    forks = [eng.fork("f0", f"f{i}") for i in (1, 2)]
    assert eng.step_stats.read_slots == reads  # no forward ran
    assert [f.first_token for f in forks] == [src.first_token] * 2
    assert [f.n_computed for f in forks] == [src.n_computed] * 2
    for e in eng.drain_events():
        events.setdefault(e.request_id, []).append(e)
    assert [_tokens(events[f"f{i}"]) for i in range(3)] == [[src.first_token]] * 3
    m = eng.pool.manager
    blocks = [set(m.blocks(r.seq)) for r in eng._live.values()]
    assert not (blocks[0] & blocks[1] or blocks[0] & blocks[2] or blocks[1] & blocks[2])
    m.allocator.check_consistency()
    for i, f in enumerate(forks, start=1):
        eng.insert(f, i)
    state, toks = eng.generate(eng.state)  # one step, then fork a decoding request
    eng.insert(eng.fork("f1", "f3"), 3)
    while any(s is not None for s in state.slots):
        state, toks = eng.generate(state)
    for e in eng.drain_events():
        events.setdefault(e.request_id, []).append(e)
    want = _reference(model, [prompt], 6)[0]
    assert [_tokens(events[f"f{i}"]) for i in range(3)] == [want] * 3
    assert _tokens(events["f3"]) == want[1:]  # its first event carries f1's last token
    assert [_check_stream(events[f"f{i}"]) for i in range(4)] == [TOK.decode(want)] * 4
    assert eng.metrics().kv_blocks_used == 0
    eng.insert(eng.prefill(Request("g0", prompt, SamplingParams(max_new_tokens=6))), 0)
    with pytest.raises(RequestError, match="request_id"):
        eng.fork("g0", "g0")
    with pytest.raises(ValueError, match="not a live prefilled request"):
        eng.fork("nobody", "g1")
    used = eng.metrics().kv_blocks_used
    for i in range(1, 4):  # the 24 blocks hold four copies of its 5 blocks, not five
        eng.fork("g0", f"g{i}")
    with pytest.raises(OutOfBlocksError):
        eng.fork("g0", "g4")
    assert eng.metrics().kv_blocks_used == 4 * used and "g4" not in eng._live
