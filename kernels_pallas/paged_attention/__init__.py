"""Paged decode attention: one query token per sequence over token-major KV pages."""
from kernels_pallas.paged_attention.api import paged_decode_attention
from kernels_pallas.paged_attention.kernel import BlockSizes
from kernels_pallas.paged_attention.reference import (gather_sequences, mapped_tokens,
                                                      paged_attention_reference,
                                                      paged_decode_attention_reference)

__all__ = ["paged_decode_attention", "paged_decode_attention_reference",
           "paged_attention_reference", "gather_sequences", "mapped_tokens", "BlockSizes"]
