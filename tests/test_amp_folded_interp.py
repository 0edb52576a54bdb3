"""Interpreter tier of the folded mixed-precision step: with Triton forced (``TRITON_INTERPRET=1``,
CPU tensors), the read-only norm + inf kernel and the fused AdamW kernel unscaling and clipping
the raw bf16/fp16 gradients give bit for bit the parameters, masters, optimizer state, norms and
scaler of the unscaling step (the unscale kernel writing fp32 main gradients, AdamW reading
them): fp16 with a skipped step, bf16 without a scaler, fp32 LayerNorm beside them, clipping on.
Bit for bit on purpose: both paths run the same kernels' fp32 products and sums in the same order
(``tests/_amp_folded.py``'s ``assert_same``), so no machine's rounding can separate them.
"""

from __future__ import annotations

import pytest
import torch
from _amp_folded import assert_same, pair, train

from fastpar.ops import backend

interpreter = pytest.mark.interpreter


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_interp_folded_step_matches_the_unscaling_step(dtype):
    from fastpar.kernels import adamw, unscale_norm  # defines kernels: import lazily

    adamw._TABLES.clear()
    unscale_norm._TABLES.clear()
    scaler = dtype == torch.float16
    with backend.use_backend("triton"):
        (ma, oa), (mb, ob) = pair(dtype, scaler=scaler, fp32_norm=True)
        inf_at = 1 if scaler else None
        a = (ma, oa, train(ma, oa, 4, inf_at=inf_at))
        b = (mb, ob, train(mb, ob, 4, inf_at=inf_at))
    assert adamw._TABLES and unscale_norm._TABLES  # both ran the Triton kernels
    assert_same(a, b)
    assert [bool(s) for s, _ in b[2]] == [False, scaler, False, False]
    assert all(float(n) > 0.05 for s, n in b[2] if not s)  # clipping active
