"""The serving engine on the real SmolLM2-135M (f32 KV): greedy continuous batching with
staggered arrivals equals `generate`, prefix-cache hits on the shared chat system prompt,
one seed's tokens whatever the batch, multi-byte streaming with the real tokenizer.

(Named to run after test_generate.py in this folder's pytest process: the reference
`generate` call has that file's shapes, so its compile is shared.)
"""
import pytest

from research.serving.api import Request, SamplingParams
from research.serving.engine import ServingEngine, TextStream
from research.decode.generate import default_stop_tokens, generate

# 37-token chat prompts: generate() pads them like test_generate's France question
QUESTIONS = ["What is the capital of France?", "What is the capital of Italy?",
             "Write a haiku about snow.", "What is 2+2?"]


def _run(engine, requests):
    out, pending = {}, list(requests)
    while pending or engine.has_work():
        if pending:  # one arrival per step: requests join and leave a running batch
            engine.add_request(pending.pop(0))
        for e in engine.step():
            out.setdefault(e.request_id, []).append(e)
    return out


def test_smollm2_engine_greedy_equals_generate_with_prefix_hits_and_seeds(smollm2):
    model, tok = smollm2
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS]
    assert {len(p) for p in prompts} == {37}
    # generate's own programs compile first: metrics().compiles counts the process's compiles
    wants = [generate(model, [p], max_new_tokens=12, stop_tokens=default_stop_tokens(tok)).tokens[0]
             for p in prompts]
    engine = ServingEngine(model, tok, n_blocks=12, block_size=16, max_batch=2, max_len=64,
                           token_budget=18, prefill_chunk=16, max_prefill_rows=1)
    compiles0 = engine.metrics().compiles
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_new_tokens=6)
    reqs = [Request(f"q{i}", tuple(p), SamplingParams(max_new_tokens=12))
            for i, p in enumerate(prompts)]
    reqs.insert(2, Request("sampled", tuple(prompts[0]), sampled))
    out = _run(engine, reqs)
    for r, want in zip(reqs[:2] + reqs[3:], wants):
        events = out[r.request_id]
        assert [e.token_id for e in events if e.token_id is not None] == want
        assert "".join(e.text for e in events) == tok.decode(want, skip_special=True)
    assert "Paris" in "".join(e.text for e in out["q0"])
    # the chat system prompt's first block is served from the prefix cache
    assert max(out[r.request_id][0].n_cached_prompt_tokens for r in reqs) >= 16
    assert engine.metrics().prefix_cache_hits >= 16
    # the sampled request drew the same tokens in that crowd as alone
    alone = _run(engine, [Request("sampled", tuple(prompts[0]), sampled)])
    assert [e.token_id for e in alone["sampled"]] == [e.token_id for e in out["sampled"]]
    m = engine.metrics()
    assert m.compiles == compiles0 and m.kv_blocks_used == 0


def test_real_tokenizer_streams_multibyte_characters(smollm2):
    _, tok = smollm2
    text = "héllo 世界 🎉 naïve"
    ids = tok.encode(text)
    stream = TextStream(tok)
    parts = [stream.push(t)[0] for t in ids]
    assert "".join(parts) + stream.flush() == text
    assert not any("\ufffd" in p for p in parts)  # 🎉 spans several byte tokens
    assert len(ids) > len(text.split())  # (several tokens per character somewhere)
