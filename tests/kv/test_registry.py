"""The KV codec registry (research/serving/kv_codecs.py): lookups and errors, calibrated codecs,
and a new codec added the documented way (one KVCodec + one registration) running in
every layout and served by the engine with generate's tokens."""
import jax
import jax.numpy as jnp
import pytest
from flax import struct

from research.serving import kv_codecs as registry
from research.kv.codec import KVCodec
from research.kv.layouts import replace_codecs
from research.kv.paged import paged_kv_cache
from research.serving.api import Request, SamplingParams
from research.serving.engine import ServingEngine
from research.decode.generate import generate
from research.transforms import calibrate_and_apply, stateless
from tests.serving.test_engine import CharTokenizer
from tests.serving.test_engine_reads import base  # noqa: F401 - the fixture: a tiny model


@struct.dataclass
class Int4Codec(KVCodec):
    """The toy codec: symmetric int4 per (token, KV head) in an int8 container, float16
    scale (docs/extending.md's recipe, Int8Codec with 7 levels a side)."""

    def record_spec(self, n_kv_heads, head_dim):
        codes = jax.ShapeDtypeStruct((n_kv_heads, head_dim), jnp.dtype(jnp.int8))
        scale = jax.ShapeDtypeStruct((n_kv_heads, 1), jnp.dtype(jnp.float16))
        return {"k": codes, "k_scale": scale, "v": codes, "v_scale": scale}

    def encode(self, k, v, positions):
        out = {}
        for name, x in (("k", k), ("v", v)):
            x = x.astype(jnp.float32)
            scale = (jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 7).astype(jnp.float16)
            s = scale.astype(jnp.float32)
            out[name] = jnp.clip(jnp.round(x / jnp.where(s > 0, s, 1)), -7, 7).astype(jnp.int8)
            out[f"{name}_scale"] = scale
        return out

    def decode(self, records, positions):
        return tuple(records[x].astype(jnp.float32) * records[f"{x}_scale"].astype(jnp.float32)
                     for x in ("k", "v"))

    def describe(self):
        return "int4-toy"


@pytest.fixture
def toy():
    spec = registry.register(registry.CodecSpec(
        "int4-toy", lambda seed: stateless(
            lambda model, state: replace_codecs(model, lambda i: Int4Codec(), "int4_kv",
                                                "int4-toy"), "int4"),
        calibrated=False, pages=True, summary="toy int4 codec (tests)"))
    yield spec
    registry.unregister(spec.name)


def test_lookups_and_errors(toy):
    assert "int4-toy" in registry.names(pages=True)
    assert "kivi-2bit" in registry.names(pages=False)
    assert set(registry.names()) >= {"f32", "bf16", "int8", "tasq-1bit"}
    with pytest.raises(ValueError, match="already registered"):
        registry.register(toy)
    with pytest.raises(ValueError, match="unknown KV codec 'nope'; registered"):
        registry.get("nope")
    with pytest.raises(ValueError, match="non-empty word"):
        registry.CodecSpec("two words", toy.make, False, True, "")


def test_a_calibrated_codec_needs_calibration(base):
    assert registry.get("tasq-1bit").calibrated
    with pytest.raises(ValueError, match="calibrated: pass calibration"):
        registry.codec_model(base, "tasq-1bit")


def test_a_registered_toy_codec_runs_in_every_layout_and_in_the_engine(toy, base):
    tok = CharTokenizer()
    prompts = [tok.encode(p) for p in ("hello world, a test", "abc", "the quick brown fox")]
    model = registry.codec_model(base, "int4-toy")
    assert all(c.codec.describe() == "int4-toy" for c in model.caches)
    want = generate(model, prompts, max_new_tokens=10, stop_tokens=(tok.eos_id,)).tokens
    paged = calibrate_and_apply(paged_kv_cache(block_size=8), model, None)[0]
    assert generate(paged, prompts, max_new_tokens=10, stop_tokens=(tok.eos_id,)).tokens == want
    f32 = generate(base, prompts, max_new_tokens=10, stop_tokens=(tok.eos_id,)).tokens
    assert f32 != want  # int4 changes the model's tokens: the codec is really in use
    engine = ServingEngine(model, tok, n_blocks=48, block_size=8, max_batch=4, max_len=64,
                           token_budget=32, prefill_chunk=16)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tuple(p), SamplingParams(max_new_tokens=10)))
    got = {}
    while engine.has_work():
        for e in engine.step():
            if e.token_id is not None:
                got.setdefault(e.request_id, []).append(e.token_id)
    assert [got.get(f"r{i}", []) for i in range(len(prompts))] == want


def test_the_server_serves_exactly_the_registered_paging_codecs(toy, base):
    """--kv_codec's choices are the registry's servable codecs; a codec that cannot page
    (KIVI's per-sequence ring) is refused by name; a new registration is served."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from research.serving import server
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "research.serving.server", "--kv_codec=int3"],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "kv_codec" in proc.stderr
    builtin = tuple(n for n in registry.names(pages=True) if n != "int4-toy")
    assert f"one of <{'|'.join(builtin)}>" in proc.stderr, proc.stderr[-600:]
    served = server.kv_codec_model(base, CharTokenizer(), "int4-toy")
    assert all(c.codec.describe() == "int4-toy" for c in served.caches)
    with pytest.raises(ValueError, match="kv_codec must be one of .*got 'kivi-2bit'"):
        server.kv_codec_model(base, CharTokenizer(), "kivi-2bit")
