"""servax's GGUF dequantizers against the gguf package's reference implementation."""
import gguf
import numpy as np
import pytest

from research.model.dequant import (
    DEQUANTIZERS, UnsupportedQuantization, dequantize, gguf_types, supported_types)
from tests.model.gguf_writer import K_QUANTIZERS, random_blocks

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


OWN_BLOCK_TYPES = sorted(set(DEQUANTIZERS) - {"F32", "F16", "BF16"})


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("type_name", OWN_BLOCK_TYPES)
def test_own_dequantizer_matches_gguf_on_random_blocks(type_name, seed):
    """Arbitrary valid blocks (not only what a quantizer emits): every nibble and scale."""
    rng = np.random.default_rng([seed, *type_name.encode()])
    raw = random_blocks(type_name, 40, rng)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(-1)
    np.testing.assert_array_equal(dequantize(raw, type_name, expected.shape), expected)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_own_float_types_match_gguf_on_random_bits(type_name):
    """Every bit pattern, NaN and inf included (compared NaN-equal)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    width = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.random.default_rng(width).integers(0, 256, (5, 64 * width), dtype=np.uint8)
    expected = gguf.quants.dequantize(raw, qtype).reshape(5, 64)
    np.testing.assert_array_equal(dequantize(raw, type_name, (5, 64)), expected)


def test_k_quants_and_more_come_from_gguf():
    for name in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_XS", "TQ2_0"]:
        assert name in gguf_types() and name in supported_types()


@pytest.mark.parametrize("type_name", sorted(gguf_types() - set(DEQUANTIZERS)))
def test_types_without_own_dequantizer_go_through_gguf(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_blocks(type_name, 6, np.random.default_rng(size))
    expected = gguf.quants.dequantize(raw, qtype).reshape(3, 2 * block)
    with np.errstate(over="ignore"):  # random MXFP4 exponents overflow
        got = dequantize(raw.reshape(3, 2 * size), type_name, (3, 2 * block))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("type_name", sorted(K_QUANTIZERS))
def test_helper_k_quantizers_pack_as_gguf_reads(type_name):
    """The tests' Q4_K/Q6_K quantizers (gguf cannot quantize K-quants) pack bytes the way
    gguf dequantizes them: values come back within about half a quantization step."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, 512)) * rng.uniform(0.01, 2, (4, 1))).astype(np.float32)
    got = dequantize(K_QUANTIZERS[type_name](x), type_name, x.shape)
    sub = 32 if type_name == "Q4_K" else 16
    xs = x.reshape(-1, sub)
    if type_name == "Q4_K":
        step = (xs.max(1) - np.minimum(xs.min(1), 0)) / 15
    else:
        step = np.abs(xs).max(1) / 31
    err = np.abs(got - x).reshape(-1, sub).max(1)
    assert np.all(err <= 0.75 * step + 1e-6), float(np.max(err / step))


def test_unsupported_type_names_supported_ones():
    with pytest.raises(UnsupportedQuantization, match="Q8_K is not supported.*Q6_K"):
        dequantize(np.zeros(292, np.uint8), "Q8_K", (256,))


def test_truncated_blocks_are_an_error():
    with pytest.raises(ValueError, match="blocks"):
        dequantize(np.zeros(33, np.uint8), "Q8_0", (32,))


def test_wrong_shape_is_an_error():
    raw = gguf.quants.quantize(np.ones((1, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="expected shape"):
        dequantize(raw, "Q8_0", (2, 32))
