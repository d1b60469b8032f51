"""Slow engine checks (real SmolLM2 with TaSQ 1-bit codes in pages and speculative
decoding; bf16 / int8 KV on a tiny model): each builds and warms its own engine."""
import jax
import numpy as np
import pytest

from research.model import init_params, make_model, tiny_config
from research.serving.api import Request, SamplingParams
from research.serving.engine import ServingEngine
from research.decode.generate import default_stop_tokens, generate
from research.tasq import CQCodec, TaSQConfig, VQCodec, int8_kv, tasq
from research.transforms import CalibrationData, calibrate_and_apply

QUESTIONS = ["What is the capital of France?", "Write a haiku about snow.",
             "Repeat after me: one two three, one two three, one two three."]


def _serve(engine, requests):
    out, pending = {}, list(requests)
    while pending or engine.has_work():
        if pending:
            engine.add_request(pending.pop(0))
        for e in engine.step():
            out.setdefault(e.request_id, []).append(e)
    return {k: [e.token_id for e in v if e.token_id is not None] for k, v in out.items()}


def _chat(tok, q):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))


def _check_equals_generate(model, tok, engine, prompts, n):
    reqs = [Request(f"r{i}", tuple(p), SamplingParams(max_new_tokens=n))
            for i, p in enumerate(prompts)]
    compiles0 = engine.metrics().compiles
    got = _serve(engine, reqs)
    assert engine.metrics().compiles == compiles0  # served without compiling
    want = generate(model, prompts, max_new_tokens=n, stop_tokens=default_stop_tokens(tok),
                    max_len=engine.max_len).tokens
    for r, w in zip(reqs, want):
        assert got[r.request_id] == w


# slow: TaSQ calibration on SmolLM2, engine warm-up, generate compiles (15 min measured
# on the shared 2-core machine under load ~20; far less on an idle one)
@pytest.mark.slow
def test_smollm2_tasq_1bit_paged_equals_tasq_dense_generate(smollm2):
    model, tok = smollm2
    cal = CalibrationData.from_corpus(tok, 128, 8)
    cfg = TaSQConfig(bits=1, kmeans_iters=4, max_points=1024)
    quantized, _ = calibrate_and_apply(tasq(cfg), model, cal)
    assert isinstance(quantized.caches[0].codec, (CQCodec, VQCodec))  # pre- or post-RoPE
    engine = ServingEngine(quantized, tok, n_blocks=16, block_size=16, max_batch=2,
                           max_len=80, token_budget=18, prefill_chunk=16, max_prefill_rows=1)
    _check_equals_generate(quantized, tok, engine, [_chat(tok, q) for q in QUESTIONS], 12)


# slow: SmolLM2 engine with the verify shape (3 min measured under load)
@pytest.mark.slow
def test_smollm2_speculative_greedy_equals_generate(smollm2):
    model, tok = smollm2
    engine = ServingEngine(model, tok, n_blocks=16, block_size=16, max_batch=2, max_len=96,
                           token_budget=18, prefill_chunk=16, max_prefill_rows=1,
                           speculative=4)
    _check_equals_generate(model, tok, engine, [_chat(tok, q) for q in QUESTIONS], 24)
    assert engine.spec_stats.accepted > 0


# slow: two more engines' warm-ups on a tiny model (~1 min)
@pytest.mark.slow
@pytest.mark.parametrize("codec", ["bfloat16", "int8"])
def test_tiny_bf16_and_int8_kv_serve_like_generate(codec):
    class Tok:
        def decode(self, ids, skip_special=False):
            return "".join(chr(i) for i in ids)

        def token_to_id(self, token):
            return None

    config = tiny_config(vocab_size=128, max_position=256)
    params = init_params(config, jax.random.key(3))
    params["embed"] = params["embed"] * 0.15
    if codec == "bfloat16":
        model = make_model(config, params, kv_dtype="bfloat16")
    else:
        model, _ = calibrate_and_apply(int8_kv(), make_model(config, params), None)
    engine = ServingEngine(model, Tok(), n_blocks=12, block_size=8, max_batch=3, max_len=64,
                           token_budget=19, prefill_chunk=16, stop_token_ids=())
    prompts = [list(np.random.default_rng(i).integers(32, 127, n)) for i, n in
               enumerate((5, 30, 17, 41))]
    reqs = [Request(f"r{i}", tuple(int(t) for t in p), SamplingParams(max_new_tokens=16))
            for i, p in enumerate(prompts)]
    got = _serve(engine, reqs)
    want = generate(model, prompts, max_new_tokens=16).tokens
    for r, w in zip(reqs, want):
        assert got[r.request_id] == w
