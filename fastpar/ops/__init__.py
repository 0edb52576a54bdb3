"""Ops: autograd Functions and their functional API; each picks Triton, the extension or the
pure-torch reference through ``fastpar.ops.backend.select``."""

from fastpar.ops import (
    adamw,  # noqa: F401  (registers adamw)
    cross_entropy,  # noqa: F401  (registers vocab_parallel_cross_entropy)
    fp8,  # noqa: F401  (registers fp8_quantize)
    linear_cross_entropy,  # noqa: F401  (registers vocab_parallel_linear_cross_entropy)
    moe_permute,  # noqa: F401  (registers moe_permute, moe_unpermute)
    unscale_norm,  # noqa: F401  (registers unscale_norm)
)
