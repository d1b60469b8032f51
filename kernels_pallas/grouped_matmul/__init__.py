"""Grouped matmul (tokens sorted by expert, ragged group sizes) with a Pallas kernel."""
from kernels_pallas.grouped_matmul.api import (GroupedMatmul, grouped_matmul,
                                               transposed_grouped_matmul)
from kernels_pallas.grouped_matmul.kernel import BlockSizes
from kernels_pallas.grouped_matmul.reference import gmm_reference, tgmm_reference

__all__ = ["BlockSizes", "GroupedMatmul", "gmm_reference", "grouped_matmul",
           "tgmm_reference", "transposed_grouped_matmul"]
