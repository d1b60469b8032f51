"""servax's GGUF dequantizers against the gguf package's reference implementation."""
import gguf
import numpy as np
import pytest

from research.model.dequant import UnsupportedQuantization, dequantize

TYPES = ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32"]


@pytest.mark.parametrize("type_name", TYPES)
def test_matches_gguf_reference(type_name):
    rng = np.random.default_rng(abs(hash(type_name)) % 2**32)
    shape = (6, 64)
    x = (rng.standard_normal(shape) * rng.uniform(0.1, 3)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(x, qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(shape)
    np.testing.assert_array_equal(dequantize(raw, type_name, shape), expected)


def test_quantization_error_is_small():
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    assert np.abs(dequantize(raw, "Q8_0", x.shape) - x).max() < 0.05


def test_unsupported_type_names_supported_ones():
    with pytest.raises(UnsupportedQuantization, match="Q6_K.*supported"):
        dequantize(np.zeros(210, np.uint8), "Q6_K", (256,))


def test_truncated_blocks_are_an_error():
    with pytest.raises(ValueError, match="blocks"):
        dequantize(np.zeros(33, np.uint8), "Q8_0", (32,))


def test_wrong_shape_is_an_error():
    raw = gguf.quants.quantize(np.ones((1, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="expected shape"):
        dequantize(raw, "Q8_0", (2, 32))
