"""Optimizer-state storage formats: 8- and 4-bit code books, block-wise codecs, and per-slot StateFormat."""

from .blockwise import dequantize_blockwise, num_blocks, quantize_blockwise, quantize_blockwise_reference
from .formats import BF16, FORMATS, FP16, FP32, FP64, Q4, Q8, StateFormat, choose_format, format_of, math_dtype
from .maps import code_book, dynamic_map, nearest_code_reference, pow2_map

__all__ = [
    "BF16",
    "FORMATS",
    "FP16",
    "FP32",
    "FP64",
    "Q4",
    "Q8",
    "StateFormat",
    "choose_format",
    "code_book",
    "dequantize_blockwise",
    "dynamic_map",
    "format_of",
    "math_dtype",
    "nearest_code_reference",
    "num_blocks",
    "quantize_blockwise",
    "pow2_map",
    "quantize_blockwise_reference",
]
