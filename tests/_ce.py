"""Helpers of the cross-entropy tests (the vocab-parallel CE and the fused linear CE): the torch
oracle, the cases' ignored targets and upstream gradient, and the sm_90 compile check of the
Triton kernels (no GPU needed)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from _parity import agree

# the compile checks build real (not interpreted) kernels
compiled_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="compiles kernels: not under the interpreter"
)


def torch_loss(
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(x, target) + z·logsumexp(x)²`` of logits ``x`` ``[N, V]``, in ``x``'s
    dtype (the tests pass fp32, the single-process run, and float64, the exact math): ``[N]``
    for "none", else summed ("mean": over the rows that are not ignored, 0 when all are)."""
    rows = F.cross_entropy(
        x, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
    valid = target != ignore_index
    rows = rows + z_loss * torch.logsumexp(x, dim=-1).square() * valid
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp(min=1)


@dataclass(frozen=True)
class LossCase:
    """A parity case's loss and inputs (the ops' tests extend it with their own fields)."""

    shape: tuple[int, ...] = (13,)
    vocab: int = 128
    reduction: str = "mean"
    ignore_index: int = -100
    n_ignored: int = 2
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    dtype: torch.dtype = torch.float32
    padded: bool = False  # pass vocab_size explicitly (True whenever vocab % tp != 0)
    seed: int = 0


def loss_options(case: LossCase) -> dict:
    """A test case's loss keywords, for the ops and ``torch_loss`` alike."""
    return dict(
        ignore_index=case.ignore_index,
        label_smoothing=case.label_smoothing,
        reduction=case.reduction,
        z_loss=case.z_loss,
    )


def case_loss(x: torch.Tensor, target: torch.Tensor, case: LossCase) -> torch.Tensor:
    """``torch_loss`` of ``x`` ``[N, V]`` with a test case's options; "none" comes back in
    ``case.shape``."""
    loss = torch_loss(x, target, **loss_options(case))
    return loss.reshape(case.shape) if case.reduction == "none" else loss


def ignore_and_upstream(target: torch.Tensor, case: LossCase, gen: torch.Generator) -> torch.Tensor:
    """Set ``case.n_ignored`` random entries of ``target`` to ``case.ignore_index`` (in place);
    return the upstream gradient: ``[*case.shape]`` in [0.5, 1.5) for reduction "none", else
    the scalar 1.7."""
    flat = target.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[: case.n_ignored]] = case.ignore_index
    if case.reduction == "none":
        return torch.rand(case.shape, generator=gen) + 0.5
    return torch.tensor(1.7)


def assert_loss_agrees(
    loss: torch.Tensor,
    single: torch.Tensor,
    exact: torch.Tensor,
    where: str,
    *,
    length: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """An op's loss (fp32, ``exact``'s shape) against the same loss from the single-process
    torch run (``single``) and in float64 (``exact``) by the rule of ``fastpar.tolerance``
    (``_parity.agree``: error against float64 at most 4 x the single run's own + the floor);
    ``length``: the longest sum feeding it (the vocabulary, or the rows a reduction adds);
    ``dtype``: the working precision (of the logits it was computed from); ``where`` leads the
    message."""
    assert loss.dtype == torch.float32 and loss.shape == exact.shape, where
    agree(loss, single, exact, f"{where}: loss", length=length, dtype=dtype)


def grad_spec(
    vocab_start: int,
    n_valid: int,
    vocab_size: int,
    label_smoothing: float = 0.1,
    z_loss: float = 1e-3,
) -> dict:
    """The keywords of the gradient launchers (``grad_logits`` / ``grad_logits_``, Triton and
    reference) for a shard whose columns ``j < n_valid`` are the global ids ``vocab_start + j``;
    ignore_index -100."""
    return dict(
        vocab_start=vocab_start,
        n_valid=n_valid,
        ignore_index=-100,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        vocab_size=vocab_size,
    )


def grad_kernel_signature(dtype: str, in_place: bool = False) -> dict:
    """The argument types of ``fastpar.kernels.cross_entropy._grad_kernel`` for logits of
    ``dtype`` ("fp32", "bf16", "fp16"); ``in_place``: ``grad_ptr`` None (a constexpr)."""
    return {
        "logits_ptr": f"*{dtype}",
        "grad_ptr": "constexpr" if in_place else f"*{dtype}",
        "target_ptr": "*i64",
        "max_ptr": "*fp32",
        "log_s_ptr": "*fp32",
        "row_grad_ptr": "*fp32",
        "row_stride": "i64",
        "n_cols": "i32",
        "vocab_start": "i32",
        "n_valid": "i32",
        "ignore_index": "i32",
        "one_minus_alpha": "fp32",
        "alpha_over_v": "fp32",
        "two_z": "fp32",
        "BLOCK": "constexpr",
        "IN_PLACE": "constexpr",
    }


def compile_for_sm90(kernel, signature: dict, constexprs: dict, num_warps: int):
    """``kernel`` compiled for a Hopper GPU (sm_90) without one; skips when there is no ptxas.
    Catches type errors of the compiled (not interpreted) path."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(kernel, signature=signature, constexprs=constexprs)
    try:
        compiled = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
        )
    except RuntimeError as exc:
        if "ptxas" in str(exc) and "not found" in str(exc):
            pytest.skip(f"no ptxas: {exc}")
        raise
    assert "cubin" in compiled.asm, kernel
    return compiled


def ptxas_usage(ptx: str, tmp_path) -> tuple[int, int]:
    """(registers, spill bytes) of one compiled kernel, from ``ptxas -v``; skips without one."""
    try:  # the ptxas Triton itself compiled with (its PTX version matches)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception as exc:  # no usable ptxas, or another Triton layout
        pytest.skip(f"no ptxas to read register and spill counts: {exc}")
    arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)  # sm_90a: Triton's Hopper target
    src = tmp_path / "kernel.ptx"
    src.write_text(ptx)
    out = subprocess.run(
        [ptxas, f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "kernel.cubin")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", out.stderr)]
    spills = [
        int(a) + int(b)
        for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    ]
    assert regs and spills, out.stderr
    return max(regs), max(spills)
