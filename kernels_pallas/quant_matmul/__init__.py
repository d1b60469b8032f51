"""Quantized matmuls: int8 x int8 (prefill, W8A8) and int4-weight x float (decode, W4A16)."""
from kernels_pallas.quant_matmul.api import GROUP_SIZES, int4_matmul, int8_matmul
from kernels_pallas.quant_matmul.kernel import BlockSizes, split_activation
from kernels_pallas.quant_matmul.reference import (SYMMETRIC_ZERO, dequantize_int4,
                                                   int4_matmul_reference,
                                                   int8_matmul_reference, pack_int4,
                                                   unpack_int4)

__all__ = ["GROUP_SIZES", "int4_matmul", "int8_matmul", "BlockSizes", "split_activation",
           "SYMMETRIC_ZERO", "dequantize_int4", "int4_matmul_reference",
           "int8_matmul_reference", "pack_int4", "unpack_int4"]
