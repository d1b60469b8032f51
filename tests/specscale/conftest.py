"""Fixtures: a tiny random model with a character-level tokenizer (ids = code points < 128).

The tiny model writes noise, but every code path of the engine, verifier and search runs
on it in seconds; the real SmolLM2 path is covered by the slow tests.
"""
import jax
import pytest

from research.model import init_params, make_model, tiny_config


class CharTokenizer:
    eos_id = 4  # an ASCII control code the task text never contains

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(i) for i in ids if not (skip_special and i == self.eos_id))

    def token_to_id(self, token):
        return None


@pytest.fixture(scope="session")
def char_model():
    config = tiny_config(vocab_size=128, max_position=1024)
    params = init_params(config, jax.random.key(3))
    # Unit-norm tied embeddings make the random model copy its input token with
    # probability ~1; shrinking them gives varied, non-degenerate samples.
    params["embed"] = params["embed"] * 0.15
    return make_model(config, params)


@pytest.fixture(scope="session")
def char_tokenizer():
    return CharTokenizer()
