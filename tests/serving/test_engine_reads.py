"""What an engine step reads and writes: live blocks only (not max_len), and 16-bit pages
updated in place (no whole-pool copy in the compiled step), for float and coded pages;
the outputs still equal `generate`'s."""
import re

import jax
import numpy as np
import pytest

from research.model import init_params, make_model, tiny_config
from research.model.precision import kv_cache_dtype
from research.serving.api import Request, SamplingParams
from research.serving.engine import ServingEngine, serve_forward
from research.decode.generate import generate
from research.tasq import int8_kv
from research.transforms import calibrate_and_apply
from tests.serving.test_engine import CharTokenizer


TOK = CharTokenizer()
PROMPTS = ["hello world, this is a test", "abc", "the quick brown fox jumps"]
CODECS = {"bf16": lambda: kv_cache_dtype("bfloat16"), "int8": int8_kv}


@pytest.fixture(scope="module")
def base():
    config = tiny_config(vocab_size=128, max_position=512, head_dim=16, n_heads=4,
                         n_kv_heads=2)
    params = init_params(config, jax.random.key(5))
    params["embed"] = params["embed"] * 0.15
    return make_model(config, params)


def _served(base, codec):
    return calibrate_and_apply(CODECS[codec](), base, None)[0]


def _run(engine, n_new=12):
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", tuple(TOK.encode(p)),
                                   SamplingParams(max_new_tokens=n_new)))
    out = {}
    while engine.has_work():
        for e in engine.step():
            if e.token_id is not None:
                out.setdefault(e.request_id, []).append(e.token_id)
    return [out.get(f"r{i}", []) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("codec", [  # bf16 is slow-marked: ~45 s, int8 reads the same pages
    pytest.param(c, marks=pytest.mark.slow) if c == "bf16" else c for c in sorted(CODECS)])
def test_engine_equals_generate_and_reads_live_blocks_only(base, codec):
    """bf16 and int8 pages: the engine's greedy tokens equal generate's; doubling max_len
    at the same prompts reads exactly the same KV slots (live-length buckets)."""
    model = _served(base, codec)
    want = generate(model, [TOK.encode(p) for p in PROMPTS], max_new_tokens=12,
                    stop_tokens=(TOK.eos_id,)).tokens
    reads = []
    for max_len in (128, 256):
        engine = ServingEngine(model, TOK, n_blocks=64, block_size=8, max_batch=4,
                               max_len=max_len, token_budget=64, prefill_chunk=16,
                               min_read_len=16, prefix_cache=False)
        assert engine.table_widths()[-1] == max_len // 8
        assert _run(engine) == [list(w) for w in want]
        reads.append(engine.step_stats.read_slots)
        assert engine.metrics().compiles == 0
    assert reads[0] == reads[1]
    assert reads[0] < engine.step_stats.steps * 4 * 128  # far below rows x max_len


def test_table_widths_are_power_of_two_buckets(base):
    engine = ServingEngine(_served(base, "bf16"), TOK, n_blocks=80, block_size=8,
                           max_batch=2, max_len=300, min_read_len=32, warmup=False)
    assert engine.table_widths() == [4, 8, 16, 32, 38]
    assert [engine._table_width(n) for n in (1, 4, 5, 17, 33, 38)] == [4, 4, 8, 32, 38, 38]


def _shapes(hlo: str, dtype: str, lead: int) -> list[str]:
    return re.findall(rf"\b{dtype}\[{lead},\d+,\d+,\d+\]", hlo)


def test_a_16_bit_pool_is_updated_in_place(base):
    """XLA:CPU converts a bf16 scatter's whole operand to f32 and back; the pages are
    stored as their bits instead, so the compiled step holds no f32 (or bf16) array of
    the pool's shape, only the stored uint16 pool."""
    engine = ServingEngine(_served(base, "bf16"), TOK, n_blocks=97, block_size=8,
                           max_batch=2, max_len=64, min_read_len=64, warmup=False)
    b, w = 2, engine.table_widths()[-1]
    i32 = np.zeros((b,), np.int32)
    hlo = serve_forward.lower(
        engine._phase_models["decode"], engine.pool.pools, np.zeros((b, w), np.int32),
        np.zeros((b, 1), np.int32), i32, np.ones((b,), np.int32), np.zeros(b, np.float32),
        i32, np.ones(b, np.float32), np.zeros((b, 2), np.uint32),
        verify=False).compile().as_text()
    assert _shapes(hlo, "u16", 97)
    assert not _shapes(hlo, "f32", 97) and not _shapes(hlo, "bf16", 97)
