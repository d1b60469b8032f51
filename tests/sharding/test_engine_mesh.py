"""The serving engine with `mesh=`: params and the paged pool's KV heads split over
"tensor" (4 devices), staggered continuous batching with the prefix cache gives the
tokens of single-device `generate`; a mesh that would split the shared pool's rows is
refused."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from research.model import init_params, make_model, tiny_config
from research.serving.api import Request, SamplingParams
from research.serving.engine import ServingEngine
from research.decode.generate import generate
from research.sharding import DEFAULT_RULES, make_mesh


class CharTokenizer:
    eos_id = 4

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(i) for i in ids if not (skip_special and i == self.eos_id))

    def token_to_id(self, token):
        return None


CONFIG = tiny_config(vocab_size=128, max_position=128, n_heads=8, n_kv_heads=4,
                     head_dim=8, ffn_dim=64)
PROMPTS = ["hello world, this is", "abc", "hello world, that", "zz top"]


def test_engine_on_a_tensor_parallel_mesh_equals_generate():
    params = init_params(CONFIG, jax.random.key(3))
    params["embed"] = params["embed"] * 0.15
    model = make_model(CONFIG, params)
    tok = CharTokenizer()
    engine = ServingEngine(model, tok, n_blocks=24, block_size=8, max_batch=2, max_len=48,
                           token_budget=16, prefill_chunk=8, stop_token_ids=(),
                           prefix_cache=True, warmup=False, mesh=make_mesh(tensor=4))
    pool = engine.pool.pools[0]["k"]
    assert pool.sharding.spec == P(None, None, "tensor", None)
    assert pool.addressable_shards[0].data.shape == (24, 8, 1, 8)  # 1 of 4 KV heads
    assert engine.pool.model.params["layers"][0]["wq"].sharding.spec == P(None, "tensor")
    reqs = [Request(f"r{i}", tuple(tok.encode(p)), SamplingParams(max_new_tokens=8))
            for i, p in enumerate(PROMPTS)]
    out, pending, steps = {}, list(reqs), 0
    while pending or engine.has_work():  # one arrival per step: 4 requests, 2 slots
        if pending:
            engine.add_request(pending.pop(0))
        for e in engine.step():
            if e.token_id is not None:
                out.setdefault(e.request_id, []).append(e.token_id)
        steps += 1
        assert steps < 500
    want = generate(model, [list(r.prompt_ids) for r in reqs], max_new_tokens=8).tokens
    assert [out[r.request_id] for r in reqs] == want
    assert engine.metrics().prefix_cache_hits > 0  # "hello world, th" shared its block


def test_engine_refuses_a_mesh_that_splits_the_shared_pool():
    model = make_model(CONFIG, init_params(CONFIG, jax.random.key(0)))
    with pytest.raises(ValueError, match="data=2"):
        ServingEngine(model, CharTokenizer(), n_blocks=16, block_size=8, max_batch=2,
                      max_len=32, token_budget=8, prefill_chunk=8, warmup=False,
                      mesh=make_mesh(data=2, tensor=2))
    with pytest.raises(ValueError, match=r"cannot split \['batch', 'blocks'\]"):
        ServingEngine(model, CharTokenizer(), n_blocks=16, block_size=8, max_batch=2,
                      max_len=32, token_budget=8, prefill_chunk=8, warmup=False,
                      mesh=make_mesh(data=2), rules=DEFAULT_RULES)
