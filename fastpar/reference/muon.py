"""Pure-torch reference of Muon (docs/muon.md): the quintic Newton–Schulz iteration in the order
of operations of ``torch.optim.Muon`` (which it reproduces bit for bit when both run in bf16),
the split of a stacked parameter into its separate matrices, the shape-based learning-rate
ratio, and one single-device step over whole tensors in any dtype (float64: the exact oracle of
``fastpar.optim.Muon`` and of ``fastpar.verify --optimizer muon``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fastpar.reference.optimizer import ExactAdamW

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic iteration X <- a X + (b A + c A²) X, A = X Xᵀ (Keller Jordan's)."""
NS_STEPS = 5
NS_EPS = 1e-7
"""X is first divided by max(‖X‖_F, eps)."""
ADJUST_LR = ("match_rms_adamw", "original", "none")
"""The learning-rate ratio of an [A, B] matrix: 0.2·sqrt(max(A, B)) (Moonlight: the update's RMS
matches AdamW's, so one lr serves both), sqrt(max(1, A / B)) (Keller Jordan's), or 1."""

Blocks = tuple[int, tuple[int, ...], int]
"""(dim, sizes, repeat): ``fastpar.mesh.placement.MatrixBlocks`` as a plain tuple."""


def newton_schulz(
    g: torch.Tensor,
    steps: int = NS_STEPS,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The orthogonalised ``g`` [A, B] (≈ U Vᵀ of its SVD), computed in ``dtype`` (default
    ``g``'s) and returned in it; ``g`` is not modified."""
    if g.dim() != 2:
        raise ValueError(f"newton_schulz takes a matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype or g.dtype, copy=True)
    transposed = g.size(0) > g.size(1)
    if transposed:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if transposed else x


def lr_ratio(shape: Sequence[int], adjust_lr: str) -> float:
    """The factor of one [A, B] matrix's update (``ADJUST_LR``); ``shape`` as stored."""
    a, b = int(shape[-2]), int(shape[-1])
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, a / b))
    if adjust_lr == "none":
        return 1.0
    raise ValueError(f"adjust_lr {adjust_lr!r} must be one of {', '.join(ADJUST_LR)}")


def block_slices(extent: int, blocks: Blocks | None) -> list[list[slice]]:
    """For each separate matrix, its slices along the blocks' dim of a tensor of ``extent``
    there (None: one matrix, the whole extent)."""
    if blocks is None:
        return [[slice(0, extent)]]
    _, sizes, repeat = blocks
    period = sum(sizes)
    if period * repeat != extent:
        raise ValueError(
            f"matrix blocks {sizes} x {repeat} cover {period * repeat} rows, the tensor has "
            f"{extent}: mark the blocks of the whole tensor (fastpar.mesh.placement.mark_blocks)"
        )
    out = []
    for j, size in enumerate(sizes):
        first = sum(sizes[:j])
        out.append([slice(g * period + first, g * period + first + size) for g in range(repeat)])
    return out


def head_blocks(blocks: Blocks | None, heads, shape: Sequence[int]) -> Blocks | None:
    """The separate matrices of a whole tensor of ``shape`` orthogonalised per head: ``heads``
    (a ``fastpar.mesh.placement.MatrixHeads``: every ``size`` along ``dim`` one head) refines
    ``blocks`` (each block whole heads, along the same dim); ``blocks`` when ``heads`` is None."""
    if heads is None:
        return blocks
    dim, size = heads.dim % len(shape), heads.size
    if shape[dim] % size:
        raise ValueError(f"heads of {size} along dim {dim} do not tile a tensor of {tuple(shape)}")
    if blocks is not None and (blocks[0] % len(shape) != dim or any(n % size for n in blocks[1])):
        raise ValueError(
            f"heads of {size} along dim {dim} do not refine the matrix blocks {blocks} of a "
            f"tensor of {tuple(shape)}: mark heads along the blocks' dim, whole heads per block"
        )
    return (dim, (size,) * (shape[dim] // size), 1)


def orthogonalize(
    update: torch.Tensor,
    blocks: Blocks | None = None,
    *,
    steps: int = NS_STEPS,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    adjust_lr: str = "match_rms_adamw",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``update`` (a whole parameter: [A, B], or [E, A, B] for E experts, each its own) with
    every separate matrix (``blocks``: along one of the last two dims) replaced by its
    Newton–Schulz orthogonalisation times ``lr_ratio`` of that matrix's shape; same shape and
    dtype as ``update``."""
    if update.dim() < 2:
        raise ValueError(f"Muon orthogonalises matrices, got shape {tuple(update.shape)}")
    out = torch.empty_like(update)
    lead = update.shape[:-2]
    dim = None if blocks is None else blocks[0] % update.dim()
    if dim is not None and dim < update.dim() - 2:
        raise ValueError(f"matrix blocks along dim {blocks[0]}: give one of the last two dims")
    for index in _indices(lead):
        u, o = update[index], out[index]  # [A, B]
        local = None if dim is None else dim - len(lead)
        extent = u.shape[local] if local is not None else u.shape[0]
        for slices in block_slices(extent, blocks):
            parts = [u[s] if local == 0 or local is None else u[:, s] for s in slices]
            m = torch.cat(parts, dim=local or 0) if len(parts) > 1 else parts[0]
            z = newton_schulz(m, steps, coefficients, eps, dtype)
            z = z.to(update.dtype) * lr_ratio(m.shape, adjust_lr)
            at = 0
            for s in slices:
                n = s.stop - s.start
                piece = z[at : at + n] if local == 0 or local is None else z[:, at : at + n]
                if local == 0 or local is None:
                    o[s] = piece
                else:
                    o[:, s] = piece
                at += n
    return out


def _indices(lead: torch.Size) -> list[tuple[int, ...]]:
    """Every index into the leading (expert) dims, in order; [()] for a matrix."""
    out: list[tuple[int, ...]] = [()]
    for n in lead:
        out = [(*i, k) for i in out for k in range(n)]
    return out


@torch.no_grad()
def muon_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    blocks: Sequence[Blocks | None] | None = None,
    **options,
) -> None:
    """One Muon step of whole tensors on one device, in place (their dtype throughout):
    ``buf <- lerp(buf, g, 1 - momentum)``; the update ``lerp(g, buf, momentum)`` (Nesterov) or
    ``buf``; ``p <- p · (1 - lr · weight_decay) - lr · orthogonalize(update)``. ``options``:
    ``orthogonalize``'s keywords; ``blocks``: one per parameter (None: whole)."""
    blocks = [None] * len(params) if blocks is None else list(blocks)
    for p, g, buf, bl in zip(params, grads, momentum_buffers, blocks, strict=True):
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if nesterov else buf
        o = orthogonalize(update, bl, **options)
        p.mul_(1 - lr * weight_decay)
        p.add_(o, alpha=-lr)


class MuonReference:
    """Muon over whole tensors on one device in any dtype, as ``fastpar.optim.Muon`` steps a
    model: ``muon_step_`` on the groups with ``"muon": True``, ``torch.optim.AdamW`` (foreach
    off) on the others. ``blocks(p)``: the separate matrices of ``p``
    (``fastpar.optim.muon_matrices.blocks_of``; None: each parameter one matrix), split per head
    with ``per_head`` where ``heads(p)`` gives its heads (``fastpar.mesh.placement.matrix_heads``;
    ``head_blocks``). Shows
    ``param_groups``, ``state`` (AdamW's), ``step()`` and ``zero_grad()``."""

    def __init__(
        self,
        param_groups: Sequence[dict],
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        blocks=None,
        per_head: bool = False,
        heads=None,
        **options,
    ) -> None:
        if per_head and heads is None:
            raise ValueError(
                "MuonReference(per_head=True) needs heads=: the heads of a parameter "
                "(fastpar.mesh.placement.matrix_heads)"
            )
        adam = [dict(g) for g in param_groups if not g["muon"]]
        self.adamw = (
            torch.optim.AdamW(
                adam, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
            )
            if adam
            else None
        )
        # AdamW's own group dicts (an lr set on one reaches it), then Muon's
        muon = [{"betas": betas, "eps": eps, **g} for g in param_groups if g["muon"]]
        self.param_groups = [*(self.adamw.param_groups if adam else []), *muon]
        self.lr, self.momentum, self.nesterov, self.weight_decay = (
            lr,
            momentum,
            nesterov,
            weight_decay,
        )
        self.blocks, self.options = blocks or (lambda p: None), options
        self.per_head, self.heads = per_head, heads
        self.buffers: dict[torch.Tensor, torch.Tensor] = {}

    @property
    def state(self):
        return {} if self.adamw is None else self.adamw.state

    @torch.no_grad()
    def step(self) -> None:
        if self.adamw is not None:
            self.adamw.step()
        for g in self.param_groups:
            if not g["muon"]:
                continue
            ps = [p for p in g["params"] if p.grad is not None]
            bufs = [self.buffers.setdefault(p, torch.zeros_like(p)) for p in ps]
            muon_step_(
                ps,
                [p.grad for p in ps],
                bufs,
                lr=g.get("lr", self.lr),
                momentum=g.get("momentum", self.momentum),
                nesterov=g.get("nesterov", self.nesterov),
                weight_decay=g.get("weight_decay", self.weight_decay),
                blocks=[self._blocks(p) for p in ps],
                **self.options,
            )

    def _blocks(self, p: torch.Tensor) -> Blocks | None:
        if not self.per_head:
            return self.blocks(p)
        return head_blocks(self.blocks(p), self.heads(p), p.shape)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None


class ExactMuon(ExactAdamW):
    """``fastpar.verify``'s float64 reference of ``--optimizer muon``: ``ExactAdamW``'s norm,
    clipping and skips around ``MuonReference`` (``muon`` options: its keywords). Its
    ``denominators`` are AdamW's parameters' only (a Muon matrix gets no AdamW slack)."""

    def __init__(
        self,
        param_groups: Sequence[dict],
        *,
        lr: float,
        max_grad_norm: float | None = None,
        skips: Sequence[bool] = (),
        **muon,
    ) -> None:
        super().__init__(param_groups, lr=lr, max_grad_norm=max_grad_norm, skips=skips)
        self.optimizer = MuonReference(param_groups, lr=lr, **muon)
