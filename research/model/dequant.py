"""GGUF tensor dequantization in numpy.

servax's own dequantizers cover the float types and the 32-weight block types below; tests
cross-check them against `gguf.quants.dequantize` on fresh random blocks. Every other type
that the `gguf` package can dequantize (the K-quants Q2_K..Q6_K that Q4_K_M and friends mix,
Q5_0/Q5_1, the IQ and TQ types, MXFP4, ...) goes through `gguf.quants.dequantize`, so a file
loads whenever the reference implementation can read its tensors.

Own block formats (32 weights per block, little endian):
  Q8_0: f16 scale d, 32 x int8 q            -> w = d * q
  Q4_0: f16 d, 16 bytes of nibbles          -> w = d * (q - 8)
  Q4_1: f16 d, f16 m, 16 bytes of nibbles   -> w = d * q + m
Nibble layout: byte j holds weight j (low nibble) and weight j + 16 (high nibble).
"""
from __future__ import annotations

import functools

import numpy as np

BLOCK = 32


class UnsupportedQuantization(ValueError):
    pass


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size % block_bytes:
        raise ValueError(f"{raw.size} bytes is not a whole number of {block_bytes}-byte blocks")
    return raw.reshape(-1, block_bytes)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + BLOCK)
    return (_f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def dequant_q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 2 + BLOCK // 2)
    return (_f16(b, 0) * (_nibbles(b[:, 2:]) - 8.0)).reshape(-1)


def dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, 4 + BLOCK // 2)
    return (_f16(b, 0) * _nibbles(b[:, 4:]) + _f16(b, 2)).reshape(-1)


def _float(dtype):
    return lambda raw: np.ascontiguousarray(raw).view(np.uint8).view(dtype).astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    u16 = np.ascontiguousarray(raw).view(np.uint8).view(np.uint16).astype(np.uint32)
    return (u16 << 16).view(np.float32)


DEQUANTIZERS = {"F32": _float(np.float32), "F16": _float(np.float16), "BF16": _bf16,
                "Q8_0": dequant_q8_0, "Q4_0": dequant_q4_0, "Q4_1": dequant_q4_1}


def _gguf_type(type_name: str):
    import gguf
    return gguf.GGMLQuantizationType[type_name]


@functools.cache
def gguf_types() -> frozenset[str]:
    """Type names `gguf.quants.dequantize` can dequantize (probed on one zero block each)."""
    import gguf
    names = set()
    for t in gguf.GGMLQuantizationType:
        _, size = gguf.GGML_QUANT_SIZES.get(t, (0, 0))
        if not size:
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), t)
        except NotImplementedError:
            continue
        names.add(t.name)
    return frozenset(names)


def supported_types() -> list[str]:
    """Every GGUF tensor type `dequantize` accepts: servax's own plus gguf's."""
    return sorted(set(DEQUANTIZERS) | gguf_types())


def dequant_gguf(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Flat f32 values of `raw` through `gguf.quants.dequantize` (the reference)."""
    import gguf
    qtype = _gguf_type(type_name)
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    out = gguf.quants.dequantize(_blocks(raw, block_bytes), qtype)
    return np.asarray(out, np.float32).reshape(-1)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize GGUF tensor bytes to f32 with numpy `shape` (GGUF dims reversed).

    servax's own dequantizer where it has one, else `gguf.quants.dequantize`.
    """
    if type_name in DEQUANTIZERS:
        flat = DEQUANTIZERS[type_name](raw)
    elif type_name in gguf_types():
        flat = dequant_gguf(raw, type_name)
    else:
        raise UnsupportedQuantization(
            f"GGUF tensor type {type_name} is not supported (neither servax nor the gguf "
            f"package dequantizes it); supported: {supported_types()}")
    if flat.size != int(np.prod(shape)):
        raise ValueError(f"tensor data holds {flat.size} values, expected {shape=}")
    return flat.reshape(shape)
