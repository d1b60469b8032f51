"""GGUF loading: round trip of written files, and clear errors for bad files."""
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import GGUFError, forward, init_params, load, make_model, tiny_config
from research.model.config import MoEConfig
from research.model.gguf_loader import unpermute_qk
from tests.model.gguf_writer import (
    byte_vocab, permute_qk, q4_k_m_type, random_blocks, write_llama_gguf)

VOCAB = len(byte_vocab()[0])


def _config(**kw):
    kw.setdefault("head_dim", 16)
    return tiny_config(vocab_size=VOCAB, **kw)


def _assert_params_equal(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


def test_unpermute_inverts_the_converter_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5))
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)


@pytest.mark.parametrize("tied", [True, False])
def test_f32_round_trip(tmp_path, tied):
    config = _config(tie_embeddings=tied)
    params = init_params(config, jax.random.key(1))
    path = write_llama_gguf(tmp_path / "m.gguf", config, params)
    model, tok = load(path)
    assert model.config.norm_eps == pytest.approx(config.norm_eps)  # stored as f32
    assert model.config == config.replace(bos_token_id=0, eos_token_id=1,
                                          norm_eps=model.config.norm_eps)
    _assert_params_equal(model.params, params, rtol=0, atol=0)
    assert tok.decode(tok.encode("the thin tin")) == "the thin tin"
    if tied:  # non-UTF-8 input (lone surrogates) is named, not a tokenizers TypeError
        bad = b"thin \xff tin".decode("utf-8", "surrogateescape")
        with pytest.raises(ValueError, match=r"text is not valid UTF-8 text: character 5 is "
                                             r"byte 0xff of non-UTF-8 input"):
            tok.encode(bad)


def test_moe_round_trip(tmp_path):
    config = _config(moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24))
    params = init_params(config, jax.random.key(2))
    model, _ = load(write_llama_gguf(tmp_path / "moe.gguf", config, params))
    assert model.config.moe == config.moe
    _assert_params_equal(model.params, params, rtol=0, atol=0)


def test_q8_0_file_is_close_and_runs(tmp_path):
    config = _config(dim=64, ffn_dim=64)
    params = init_params(config, jax.random.key(3))
    model, _ = load(write_llama_gguf(tmp_path / "q8.gguf", config, params, qtype="Q8_0"))
    _assert_params_equal(model.params, params, atol=0.05)
    ref = forward(make_model(config, params), jnp.arange(10)[None] % VOCAB).logits
    got = forward(model, jnp.arange(10)[None] % VOCAB).logits
    assert float(jnp.max(jnp.abs(got - ref))) < 0.1 * float(jnp.max(jnp.abs(ref)))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load(tmp_path / "nope.gguf")


def test_corrupt_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="bad.gguf.*not a readable GGUF"):
        load(bad)


def test_truncated_file(tmp_path):
    config = _config()
    path = write_llama_gguf(tmp_path / "t.gguf", config, init_params(config, jax.random.key(0)))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(GGUFError, match="t.gguf"):
        load(path)


def test_unsupported_architecture(tmp_path):
    config = _config()
    path = write_llama_gguf(tmp_path / "g.gguf", config, init_params(config, jax.random.key(0)),
                            arch="gpt2")
    with pytest.raises(GGUFError, match="g.gguf.*architecture 'gpt2'"):
        load(path)


def test_unsupported_quant_type(tmp_path):
    """Q8_K is an intermediate type llama.cpp never writes to files; gguf cannot read it."""
    config = _config(dim=256, ffn_dim=256, head_dim=64)
    path = write_llama_gguf(tmp_path / "k.gguf", config,
                            init_params(config, jax.random.key(0)), qtype="Q8_K")
    with pytest.raises(GGUFError, match="k.gguf.*Q8_K is not supported"):
        load(path)


def test_rope_frequency_factors_are_refused_not_ignored(tmp_path):
    config = _config()
    params = init_params(config, jax.random.key(0))
    ones = write_llama_gguf(tmp_path / "ones.gguf", config, params,
                            extra_tensors={"rope_freqs.weight": np.ones(8)})
    _assert_params_equal(load(ones)[0].params, params, rtol=0, atol=0)
    factors = np.r_[np.ones(4), 8 * np.ones(4)]
    scaled = write_llama_gguf(tmp_path / "l31.gguf", config, params,
                              extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(GGUFError, match=r"l31.gguf.*rope_freqs.*factors 1\.\.8"):
        load(scaled)


def _k_config(**kw):  # K-quant rows are whole 256-weight blocks
    return _config(dim=256, ffn_dim=256, head_dim=64, n_heads=4, n_kv_heads=2, **kw)


def _gguf_reference_params(path, config):
    """Params in servax's layout, every tensor dequantized by `gguf.quants.dequantize`."""
    reader = gguf.GGUFReader(str(path))
    t = {x.name: gguf.quants.dequantize(x.data, x.tensor_type).reshape(
        tuple(reversed([int(d) for d in x.shape]))) for x in reader.tensors}
    layers = []
    for i in range(config.n_layers):
        g = lambda n: t[f"blk.{i}.{n}.weight"]  # noqa: E731
        layers.append({"attn_norm": g("attn_norm"), "ffn_norm": g("ffn_norm"),
                       "wq": unpermute_qk(g("attn_q"), config.n_heads).T,
                       "wk": unpermute_qk(g("attn_k"), config.n_kv_heads).T,
                       "wv": g("attn_v").T, "wo": g("attn_output").T,
                       "w_gate": g("ffn_gate").T, "w_up": g("ffn_up").T,
                       "w_down": g("ffn_down").T})
    ref = {"embed": t["token_embd.weight"], "final_norm": t["output_norm.weight"],
           "layers": tuple(layers)}
    if "output.weight" in t:
        ref["lm_head"] = t["output.weight"].T
    return reader, ref


def _write_q4_k_m(path, config, params):
    return write_llama_gguf(path, config, params,
                            qtype=lambda name: q4_k_m_type(name, config.n_layers),
                            file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)


def test_q4_k_m_file_matches_gguf_dequantization_and_runs(tmp_path):
    config = _k_config(tie_embeddings=False)
    params = init_params(config, jax.random.key(4))
    path = _write_q4_k_m(tmp_path / "q4km.gguf", config, params)
    reader, ref = _gguf_reference_params(path, config)
    types = {x.name: x.tensor_type.name for x in reader.tensors}
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert {"Q4_K", "Q6_K"} <= set(types.values())  # the mix, as llama.cpp writes it
    assert types["output.weight"] == "Q6_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    model, _ = load(path)
    assert jax.tree.structure(model.params) == jax.tree.structure(ref)
    _assert_params_equal(model.params, ref, rtol=0, atol=0)  # exactly gguf's values
    _assert_params_equal(model.params, params, atol=0.1)  # and close to the originals
    tokens = jnp.arange(12)[None] % VOCAB
    ref_logits = forward(make_model(config, params), tokens).logits
    got = forward(model, tokens).logits
    assert bool(jnp.all(jnp.isfinite(got)))
    # ~8% weight error at 4 bits (measured 26% on these random-init logits, correlation 0.97)
    assert float(jnp.linalg.norm(got - ref_logits) / jnp.linalg.norm(ref_logits)) < 0.4
    assert np.corrcoef(np.ravel(got), np.ravel(ref_logits))[0, 1] > 0.9


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q5_K", "Q5_0", "IQ4_NL"])
def test_other_gguf_types_load_as_gguf_dequantizes_them(tmp_path, qtype):
    """Types without a quantizer here: random valid blocks, loaded exactly as gguf reads them."""
    config = _k_config()
    path = write_llama_gguf(tmp_path / "x.gguf", config, init_params(config, jax.random.key(5)),
                            qtype=qtype)
    # overwrite each zero tensor in place with random valid blocks of its type
    reader = gguf.GGUFReader(str(path), "r+")
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        if t.tensor_type.name == qtype:
            blocks = random_blocks(qtype, t.data.size // gguf.GGML_QUANT_SIZES[t.tensor_type][1],
                                   rng)
            t.data[...] = blocks.reshape(t.data.shape)
    reader.data.flush()
    del reader
    _, ref = _gguf_reference_params(path, config)
    model, _ = load(path)
    _assert_params_equal(model.params, ref, rtol=0, atol=0)


def test_cli_generates_from_a_q4_k_m_file(tmp_path):
    """--gguf= on a Q4_K_M llama file, end to end through the generation CLI."""
    config = _k_config()
    path = _write_q4_k_m(tmp_path / "m.gguf", config, init_params(config, jax.random.key(6)))
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "research.serving.cli", f"--gguf={path}", "--nochat",
           "--prompt=the thin", "--max_new_tokens=3"]
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "### the thin\n" in proc.stdout


def test_unexpected_tensor_is_an_error(tmp_path):
    config = _config()
    path = write_llama_gguf(tmp_path / "b.gguf", config, init_params(config, jax.random.key(0)),
                            extra_tensors={"blk.0.attn_q.bias": np.zeros(64)})
    with pytest.raises(GGUFError, match="unexpected tensors.*attn_q.bias"):
        load(path)
