"""Compression: ST (top-k + ternary), error-feedback residuals, exact bit accounting."""

from driftlab.compress.error_feedback import with_compression
from driftlab.compress.ternary import compress_model, kept_entries, sparse_ternary, ternary_bits

__all__ = ["compress_model", "kept_entries", "sparse_ternary", "ternary_bits", "with_compression"]
