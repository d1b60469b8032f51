"""SmolLM2-135M-Instruct against independent implementations (tests/golden, made by
scripts/make_golden.py): transformers' Llama on the same GGUF for logits, llama.cpp's and
transformers' tokenizers for token ids."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import forward

GOLDEN = np.load(Path(__file__).parent.parent / "golden" / "smollm2_golden.npz")
TEXTS = json.loads(str(GOLDEN["texts"]))
IDS = range(len(TEXTS))


@pytest.mark.parametrize("i", IDS)
def test_token_ids_match_llama_cpp_and_transformers(smollm2, i):
    _, tok = smollm2
    ids = tok.encode(TEXTS[i])
    assert ids == GOLDEN[f"ids_{i}"].tolist()
    assert ids == GOLDEN[f"hf_ids_{i}"].tolist()
    assert tok.decode(ids) == TEXTS[i]


@pytest.fixture(scope="module")
def servax_logits(smollm2):
    """Logits of every golden text in one padded batch (causal: padding can't leak back)."""
    model, _ = smollm2
    ids = [GOLDEN[f"ids_{i}"] for i in IDS]
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, x in enumerate(ids):
        tokens[r, :len(x)] = x
    logits = jax.jit(lambda m, x: forward(m, x).logits)(model, jnp.asarray(tokens))
    return [np.asarray(logits[r, :len(x)]) for r, x in enumerate(ids)]


@pytest.mark.parametrize("i", IDS)
def test_logits_match_transformers(servax_logits, i):
    logits = servax_logits[i]
    top_ids = GOLDEN[f"top_ids_{i}"]
    # every position's top-16 logits and the last position's full row, f32 tolerance
    np.testing.assert_allclose(np.take_along_axis(logits, top_ids, -1),
                               GOLDEN[f"top_logits_{i}"], atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(logits[-1], GOLDEN[f"last_logits_{i}"], atol=1e-3, rtol=1e-4)
    lse = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(lse, GOLDEN[f"logsumexp_{i}"], atol=1e-3, rtol=1e-5)
    np.testing.assert_array_equal(logits.argmax(-1), top_ids[:, 0])


def test_agrees_with_llama_cpp_top1_mostly(servax_logits):
    """llama.cpp multiplies Q4_1 weights with Q8-quantised activations: close, not equal."""
    agree = [np.mean(servax_logits[i].argmax(-1) == GOLDEN[f"llamacpp_top1_{i}"]) for i in IDS]
    assert np.mean(agree) > 0.85


def test_chat_template(smollm2):
    _, tok = smollm2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.encode("<|im_end|>", parse_special=False) != [tok.token_to_id("<|im_end|>")]


def test_tokenizer_bad_input(smollm2):
    _, tok = smollm2
    with pytest.raises(TypeError, match="text must be str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([10**6])
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        tok.apply_chat_template([{"content": "no role"}])
