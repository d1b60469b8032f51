"""One validation of sampling settings (research/decode/sampling.py's `check_sampling`):
SamplingConfig, the engine's SamplingParams and the server's pydantic models accept the
same settings and name the same field when they refuse one."""
import math

import pydantic
import pytest
from hypothesis import given, settings, strategies as st

from research.decode.sampling import (MAX_TEMPERATURE, OPENAI_MAX_TEMPERATURE, SamplingConfig,
                                      SamplingError, check_sampling)
from research.serving import protocol as P
from research.serving.api import RequestError, SamplingParams

NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.sampled_from([0, 0.0, 1, 1.0, 2.0, 2.5, 100.0, 100.5, -0.0, -1e-9]))


def _refused(make) -> str | None:
    try:
        make()
    except (SamplingError, RequestError) as e:
        return e.field
    return None


def _api_refused(body) -> str | None:
    try:
        P.CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    except pydantic.ValidationError as e:
        return P.validation_error(e).param
    return None


@settings(max_examples=200, deadline=None, derandomize=True)
@given(temperature=NUMBERS, top_k=st.integers(-3, 1 << 20), top_p=NUMBERS)
def test_the_library_the_engine_and_the_server_share_the_bounds(temperature, top_k, top_p):
    lib = _refused(lambda: SamplingConfig(temperature, top_k, top_p))
    assert lib == _refused(lambda: SamplingParams(temperature=temperature, top_k=top_k,
                                                  top_p=top_p))
    assert lib == _refused(lambda: check_sampling(temperature, top_k, top_p))
    # the server: the same bounds, temperature at most OpenAI's 2, top_k -1 = off
    api = _api_refused({"temperature": temperature, "top_k": top_k, "top_p": top_p})
    api_top_k = 0 if top_k == -1 else top_k
    expected = _refused(lambda: check_sampling(temperature, api_top_k, top_p,
                                               max_temperature=OPENAI_MAX_TEMPERATURE))
    assert api == expected, (temperature, top_k, top_p)


def test_bounds_and_messages():
    assert MAX_TEMPERATURE == 100.0 and OPENAI_MAX_TEMPERATURE == 2.0
    with pytest.raises(SamplingError, match=r"top_p must be a number in \(0, 1\], got 0"):
        SamplingConfig(top_p=0)
    with pytest.raises(SamplingError, match="vocabulary size 8"):
        check_sampling(top_k=9, vocab_size=8)
    with pytest.raises(RequestError, match=r"temperature: must be a number in \[0, 100\]"):
        SamplingParams(temperature=math.inf)
    assert SamplingParams(temperature=0.5, top_k=3, top_p=0.9).sampling == SamplingConfig(
        0.5, 3, 0.9)
