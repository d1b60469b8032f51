"""The KV codec registry (research/serving/kv_codecs.py): lookups and errors, calibrated codecs,
a new codec running in every layout and served by the engine with generate's tokens, the
README's codec list, and docs/extending.md's codec recipe walked end to end (a KVCodec file,
a row in the table, the CLI and the real server on 127.0.0.1)."""
import inspect
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
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

ROOT = Path(__file__).resolve().parents[2]


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


class _AsciiTokenizer:
    """Corpus text into the tiny model's 128-token vocabulary (calibration only)."""

    def encode(self, text):
        return [ord(c) % 128 for c in text]


def test_served_models_calibrates_a_windowed_codecs_inner_codec_once(base, monkeypatch):
    from research.model import forward
    from research.tasq import transform as tasq_transform
    calls = []
    calibrate = tasq_transform.calibrate_state
    monkeypatch.setattr(tasq_transform, "calibrate_state",
                        lambda *a, **k: calls.append(1) or calibrate(*a, **k))
    names = ["tasq-1bit+w128", "int8", "tasq-1bit", "tasq-1bit+w128"]
    tok = _AsciiTokenizer()
    together = registry.served_models(base, tok, names, seed=3, calibration_seqs=2,
                                      calibration_len=64)
    assert list(together) == ["tasq-1bit+w128", "int8", "tasq-1bit"] and len(calls) == 1
    assert registry.get("tasq-1bit+w128").window_over == ("tasq-1bit", 4, 128)
    tokens = jnp.asarray([tok.encode("a windowed codec reads its sink and recent tokens " * 4)])
    for name in ("tasq-1bit+w128", "tasq-1bit"):  # each equals the codec built on its own
        alone = registry.served_model(base, tok, name, seed=3, calibration_seqs=2,
                                      calibration_len=64)
        assert [c.describe() for c in together[name].caches] == [
            c.describe() for c in alone.caches]
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                         together[name].params, alone.params))
        assert jnp.array_equal(forward(together[name], tokens).logits,
                               forward(alone, tokens).logits)
    assert len(calls) == 3


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


def test_the_readme_lists_exactly_the_servable_codecs():
    """README's `--kv_codec=a|b|...` is the registry's servable codecs, in its order."""
    listed = re.findall(r"`--kv_codec=([\w.|+-]+)`", (ROOT / "README.md").read_text())
    assert listed, "README.md lists no `--kv_codec=...|...` choices"
    assert [tuple(x.split("|")) for x in listed] == [registry.names(pages=True)] * len(listed)


# -- docs/extending.md's recipe, end to end ---------------------------------------------------
# Steps 1 and 2: the codec and its transform, in a module of their own (written to a temporary
# package, as a new research/kv/int4_token.py would be).
TOY_MODULE = """\
import jax
import jax.numpy as jnp
from flax import struct

from research.kv.codec import KVCodec
from research.kv.layouts import replace_codecs
from research.transforms import Transform, stateless


{codec}

def int4_kv() -> Transform:
    return stateless(lambda model, state: replace_codecs(model, lambda i: Int4Codec(),
                                                         "int4_kv", "int4-toy"), "int4")
"""
# Step 3: the factory and the row, added to the registry's table (BUILTIN) of a copy of
# kv_codecs.py (the recipe edits the file itself).
FACTORY = """\
def _int4_token(seed):
    from toy_int4 import int4_kv
    return int4_kv()


"""
ROW = """\
    CodecSpec("int4-token", _int4_token, calibrated=False, pages=True,
              summary="int4 per (token, KV head), float16 scale"),
"""
# runs research.serving's server or CLI with the copied registry in place of the real one
RUN_PATCHED = """\
import importlib.util, sys
which, patched = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("research.serving.kv_codecs", patched)
kv_codecs = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = kv_codecs
spec.loader.exec_module(kv_codecs)
import research.serving
research.serving.kv_codecs = kv_codecs
sys.argv = [which] + sys.argv[3:]
if which == "server":
    from research.serving import server
    server.run()
else:
    from absl import flags
    from research.serving import cli  # noqa: F401 - defines the CLI's flags
    flags.FLAGS(sys.argv)
    print("CLI kv_codec:", flags.FLAGS.kv_codec, flush=True)
"""


def _recipe_package(tmp_path: Path) -> Path:
    """tmp_path/toy_int4 (steps 1-2) and tmp_path/kv_codecs.py: the registry with the row."""
    (tmp_path / "toy_int4").mkdir()
    codec = "@struct.dataclass\n" + inspect.getsource(Int4Codec).split("\n", 1)[1]
    (tmp_path / "toy_int4" / "__init__.py").write_text(TOY_MODULE.format(codec=codec))
    source = (ROOT / "research" / "serving" / "kv_codecs.py").read_text()
    assert source.count("\nBUILTIN = (\n") == 1 and source.count("\n)\nfor _spec in BUILTIN:") == 1
    source = source.replace("\nBUILTIN = (\n", "\n" + FACTORY + "BUILTIN = (\n")
    source = source.replace("\n)\nfor _spec in BUILTIN:", "\n" + ROW + ")\nfor _spec in BUILTIN:")
    (tmp_path / "kv_codecs.py").write_text(source)
    (tmp_path / "run_patched.py").write_text(RUN_PATCHED)
    return tmp_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_codec_recipe_end_to_end(tmp_path, base):
    pkg = _recipe_package(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(pkg)])}

    def run_patched(which, *args, **kw):
        return subprocess.Popen([sys.executable, str(pkg / "run_patched.py"), which,
                                 str(pkg / "kv_codecs.py"), *args], cwd=ROOT, env=env,
                                text=True, **kw)

    # the row in the table: a registered, servable codec that installs in the model
    sys.path.insert(0, str(pkg))
    try:
        namespace = {}
        exec(FACTORY, namespace)  # the row, as the table holds it
        row = eval(ROW.strip().rstrip(","), {"CodecSpec": registry.CodecSpec, **namespace})
        registry.register(row)
        try:
            assert "int4-token" in registry.names(pages=True)
            model = registry.codec_model(base, "int4-token")
            assert all(c.codec.describe() == "int4-toy" for c in model.caches)
        finally:
            registry.unregister("int4-token")
        assert "int4-token" not in registry.names()
    finally:
        sys.path.remove(str(pkg))
        sys.modules.pop("toy_int4", None)

    # the CLI accepts it
    cli = run_patched("cli", "--kv_codec=int4-token", "--prompt=hi", stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0 and "CLI kv_codec: int4-token" in out, err[-800:]

    # the real server serves one request with it on 127.0.0.1
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    server = run_patched("server", "--kv_codec=int4-token", f"--port={port}", "--max_batch=1",
                         "--n_blocks=16", "--block_size=16", "--max_len=128",
                         "--token_budget=32", "--prefill_chunk=32", "--nowarmup_scoring",
                         "--log_level=warning", stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "servax: serving" not in (tmp_path / "server.log").read_text():
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the server did not start in 600 s"
            time.sleep(0.5)
        banner = (tmp_path / "server.log").read_text()
        assert "kv_codec=int4-token," in banner
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):  # the banner comes just before uvicorn binds
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["text"]
    finally:
        server.terminate()
        server.wait(30)
        log.close()
