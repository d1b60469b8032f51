"""The serving engine with a full-precision window over TaSQ codes (research/kv/windowed.py
in the paged pool: research/kv/window_pages.py): the engine's tokens are `generate`'s with
the same windowed codec through chunked prefill, speculative drafts and their rollback,
preemption by recompute, prefix-cache hits and forks; window pages stay bounded and
consistent, and none is leaked."""
import pytest

from research.kv.codec import FloatCodec
from research.kv.layouts import kv_window
from research.tasq.baselines import kivi_kv
from research.transforms import chain
from research.serving.api import Request, SamplingParams
from research.transforms import calibrate_and_apply
from tests.serving.test_engine import (PROMPTS, TOK, _engine, _greedy, _reference, _run,
                                       _tokens)
from tests.serving.test_engine import model  # noqa: F401 - the fixture: tiny TaSQ model

SINK, RECENT = 4, 16


@pytest.fixture(scope="module")
def windowed(model):  # noqa: F811
    return calibrate_and_apply(kv_window(SINK, RECENT), model, None)[0]


@pytest.fixture(scope="module")
def windowed_kivi(model):  # noqa: F811
    """KIVI 2-bit (key groups of one 8-token block) under the window: a grouped codec,
    each group written whole from the window's own bf16 copies (no per-sequence ring)."""
    base = model.replace(caches=tuple(c.replace(codec=FloatCodec()) for c in model.caches))
    kivi = chain(kivi_kv(bits=2, key_group=8, value_group=8), kv_window(SINK, RECENT))
    return calibrate_and_apply(kivi, base, None)[0]


def _pages_in_use(engine):
    pages = engine.pool.window_pages
    pages.check_consistency()
    engine.pool.manager.allocator.check_consistency()
    return pages.pages.n_used


@pytest.fixture(params=["tasq", "kivi"])
def served(request, model):  # noqa: F811
    """(windowed model, the same codec without the window) per inner codec."""
    if request.param == "tasq":
        return request.getfixturevalue("windowed"), model
    kivi = request.getfixturevalue("windowed_kivi")
    return kivi, kivi.replace(caches=tuple(c.replace(codec=c.codec.inner)
                                           for c in kivi.caches))


def test_the_windowed_engine_equals_generate(served):
    windowed, model = served
    engine = _engine(windowed, n_blocks=10, speculative=3, warmup=False)
    assert engine.pool.window_pages is not None and engine.pool.window_bytes > 0
    # short prompts, all arriving at once; 12 tokens each: every read is inside S + W
    reqs = _greedy(12)
    out = _run(engine, reqs)
    want = _reference(windowed, [r.prompt_ids for r in reqs], 12)
    assert [_tokens(out[r.request_id]) for r in reqs] == want
    # 24-token prompts growing to 44 tokens in a 10-block pool: preemption, drafts, and
    # reads of codes beyond the window
    prompts = [(p * 12)[:24] for p in PROMPTS[:4]]
    reqs = _greedy(20, prompts)
    before = engine.metrics().preemptions
    out = _run(engine, reqs)
    assert engine.metrics().preemptions > before
    assert engine.spec_stats.drafted > 0
    want = _reference(windowed, [r.prompt_ids for r in reqs], 20)
    assert [_tokens(out[r.request_id]) for r in reqs] == want
    plain = _reference(model, [r.prompt_ids for r in reqs], 20)
    assert want != plain  # the window changes what the model reads
    # the same prompts again: prefix-cache hits, as far as their window pages allow
    again = [Request(f"again{i}", r.prompt_ids, r.params) for i, r in enumerate(reqs)]
    out = _run(engine, again)
    assert [_tokens(out[r.request_id]) for r in again] == want
    assert engine.metrics().kv_blocks_used == 0
    # once nothing runs, the next sweep (before every pass) leaves only cached sink
    # blocks' pages; evicting those blocks frees the rest
    pages = engine.pool.window_pages
    pages.sweep()
    assert _pages_in_use(engine) == sum(pages.is_sink(pages.index_of[b]) for b in pages.page_of)
    assert _pages_in_use(engine) > 0
    engine.pool.prefix_cache.evict(engine.pool.n_blocks)
    assert _pages_in_use(engine) == 0


def test_a_prefix_hit_is_used_as_far_as_its_window_pages_exist(windowed, model):  # noqa: F811
    """A finished 30-token prompt's blocks stay cached; its window moved on, so only the
    sink block kept its page: the same prompt again adopts that block (8 tokens), not the
    3 full blocks a codec without a window would, and decodes generate's tokens."""
    prompt = tuple(TOK.encode("a prompt that is cached and read again"))[:30]
    params = SamplingParams(max_new_tokens=12)
    want = _reference(windowed, [prompt], 12)[0]
    cached = {}
    for name, m in (("plain", model), ("windowed", windowed)):
        engine = _engine(m, n_blocks=48, warmup=False)
        for rid in ("first", "again"):
            out = _run(engine, [Request(rid, prompt, params)])
            cached[name, rid] = out[rid][0].n_cached_prompt_tokens
            if name == "windowed":
                assert _tokens(out[rid]) == want
    assert cached["plain", "again"] == 24 and cached["windowed", "again"] == 8
    assert cached["plain", "first"] == cached["windowed", "first"] == 0
    # the first run's cached blocks lost their window pages to the sweeps of the second
    # (which cached nothing new: the same tokens), all but the sink block's
    assert _pages_in_use(engine) == 1


def test_windowed_forks_decode_generates_tokens(served):
    windowed, _ = served
    eng = _engine(windowed, prefix_cache=False, n_blocks=24, warmup=False)
    prompt = tuple(TOK.encode("one prompt forked into three decode rows"))  # 40 > S + W
    src = eng.prefill(Request("f0", prompt, SamplingParams(max_new_tokens=6)))
    eng.insert(src, 0)
    events = {e.request_id: [e] for e in eng.drain_events()}
    for i in (1, 2):
        eng.insert(eng.fork("f0", f"f{i}"), i)
    assert _pages_in_use(eng) > 0
    state = eng.state
    while any(s is not None for s in state.slots):
        state, _ = eng.generate(state)
    for e in eng.drain_events():
        events.setdefault(e.request_id, []).append(e)
    want = _reference(windowed, [prompt], 6)[0]
    assert [_tokens(events[f"f{i}"]) for i in range(3)] == [want] * 3
    assert eng.metrics().kv_blocks_used == 0
    assert _pages_in_use(eng) == 0


def test_the_pool_sizes_and_refuses_window_pages(windowed):
    from research.decode.paged_pool import PagedPool
    with pytest.raises(TypeError, match="pass window_blocks >= 1"):
        PagedPool(windowed, n_blocks=8, block_size=8, max_len=64)
    pool = PagedPool(windowed, n_blocks=8, block_size=8, max_len=64, window_blocks=3)
    per_page = pool.window_bytes // 3
    # a window page holds bf16 K and V of block_size tokens per layer
    c = windowed.config
    assert per_page == c.n_layers * 8 * 2 * c.n_kv_heads * c.head_dim * 2


def test_an_equal_budget_counts_the_window_pages_the_engine_allocates(windowed, model):  # noqa: F811,E501
    """experiments/serving/long_context's budget rows: a windowed codec's row costs its
    blocks of codes plus the bf16 window pages the engine allocates per row."""
    from experiments.serving.long_context_experiment import (block_bytes, bytes_per_row,
                                                             window_page_bytes)
    from research.serving.engine import window_pages_for
    bs, context = 8, 40  # the engine's blocks of 8: 5 blocks of a 40-token row
    code_block = block_bytes(model, bs)
    assert block_bytes(windowed, bs) == code_block  # the codes' pages are unchanged
    assert window_page_bytes(model, bs) == 0
    assert bytes_per_row(model, context, bs) == 5 * code_block
    page = window_page_bytes(windowed, bs)
    cfg = model.config
    assert page == cfg.n_layers * 2 * bs * cfg.n_kv_heads * cfg.head_dim * 2  # bf16 K, V
    engine = _engine(windowed, n_blocks=10, warmup=False)
    per_row = engine.pool.window_bytes // engine.max_batch
    assert bytes_per_row(windowed, context, bs) == 5 * code_block + per_row
    assert per_row == window_pages_for(windowed, bs, 2) * page
