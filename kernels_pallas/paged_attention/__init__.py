"""Paged decode attention: one query token per sequence over a block-table KV pool."""
from kernels_pallas.paged_attention.api import paged_decode_attention
from kernels_pallas.paged_attention.kernel import BlockSizes
from kernels_pallas.paged_attention.reference import paged_decode_attention_reference

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "BlockSizes"]
