"""Fixtures for speculative-decoding tests."""
import numpy as np
import pytest

from tests.specdecode.specdecode_helpers import chaotic_model


@pytest.fixture(scope="module")
def chaotic():
    return chaotic_model()


@pytest.fixture(scope="module")
def prompts():
    """Rows of different lengths; some repeat themselves so prompt lookup finds matches."""
    rng = np.random.default_rng(0)
    return [list(rng.integers(0, 97, 9)) * 3, list(rng.integers(0, 97, 5)),
            list(rng.integers(0, 97, 4)) * 4 + [7]]
