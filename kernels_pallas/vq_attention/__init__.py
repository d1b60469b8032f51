"""Decode attention that reads vector-quantised KV codes (TaSQ's hot path)."""
from kernels_pallas.vq_attention.api import vq_decode_attention, vq_decode_attention_paged_codes
from kernels_pallas.vq_attention.kernel import BlockSizes
from kernels_pallas.vq_attention.rope import KeyRope
from kernels_pallas.vq_attention.reference import (dequantize, vq_attention_reference,
                                                   vq_decode_attention_paged,
                                                   vq_decode_attention_reference)

__all__ = ["vq_decode_attention", "vq_decode_attention_paged_codes", "BlockSizes", "KeyRope",
           "dequantize", "vq_attention_reference", "vq_decode_attention_paged",
           "vq_decode_attention_reference"]
