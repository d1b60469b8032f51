"""GGUF loading: round trip of written files, and clear errors for bad files."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import GGUFError, forward, init_params, load, make_model, tiny_config
from research.model.config import MoEConfig
from research.model.gguf_loader import unpermute_qk
from tests.model.gguf_writer import byte_vocab, permute_qk, write_llama_gguf

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
    config = _config(dim=256, ffn_dim=256, head_dim=64)
    path = write_llama_gguf(tmp_path / "k.gguf", config,
                            init_params(config, jax.random.key(0)), qtype="Q6_K")
    with pytest.raises(GGUFError, match="k.gguf.*Q6_K is not supported"):
        load(path)


def test_unexpected_tensor_is_an_error(tmp_path):
    config = _config()
    path = write_llama_gguf(tmp_path / "b.gguf", config, init_params(config, jax.random.key(0)),
                            extra_tensors={"blk.0.attn_q.bias": np.zeros(64)})
    with pytest.raises(GGUFError, match="unexpected tensors.*attn_q.bias"):
        load(path)
