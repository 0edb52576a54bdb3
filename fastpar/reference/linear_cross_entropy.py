"""Pure-torch chunked linear cross-entropy (``chunk_loop``): the CPU path and the oracle of the
fused op; the steps of one chunk: docs/kernels.md ("Fused linear cross-entropy")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastpar.reference import cross_entropy as ce

CHUNK_ELEMENTS = 1 << 23  # default logits per chunk: 32 MiB in fp32, 16 MiB in bf16
MIN_CHUNK = 16


def default_chunk_size(n_rows: int, n_local: int) -> int:
    """Rows per chunk: the power of two nearest below ``CHUNK_ELEMENTS / n_local`` (at least
    ``MIN_CHUNK``), at most ``n_rows``. Shapes alone decide it, so every rank of the group takes
    the same number of gathers (a power of two also survives shards one row apart)."""
    rows = max(MIN_CHUNK, 1 << max(0, (CHUNK_ELEMENTS // max(n_local, 1)).bit_length() - 1))
    return max(1, min(rows, n_rows))


def grad_logits_(
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    log_s: torch.Tensor,
    row_grad: torch.Tensor,
    **options,
) -> torch.Tensor:
    """``fastpar.reference.cross_entropy.grad_logits`` (``options``: its keywords) written into
    ``logits`` itself (returned).

    ``logits`` ``[C, V_local]`` contiguous; the formula, its fp32 arithmetic and the single
    cast are those of ``grad_logits``; padding columns and rows with ``row_grad == 0`` get 0.
    Temporaries: fp32 blocks of about 2^20 elements.
    """
    return ce.grad_logits(logits, target, row_max, log_s, row_grad, in_place=True, **options)


def stats_(
    x: torch.Tensor, target: torch.Tensor, vocab_start: int, n_valid: int, ignore_index: int
) -> torch.Tensor:
    """``fastpar.reference.cross_entropy.local_stats`` of a chunk ``[C, V_local]``, fp32
    ``[C, 4]``. For fp32 ``x`` it also overwrites ``x[:, :n_valid]`` with ``exp(x − row max)``
    (whole-chunk in-place ops, no temporaries: the gradient's first step, see ``grad_``); other
    dtypes leave ``x`` untouched (in-place arithmetic there would round every step)."""
    if x.dtype != torch.float32 or n_valid <= 0 or x.shape[0] == 0:
        return ce.local_stats(x, target, vocab_start, n_valid, ignore_index)
    stats = torch.empty(x.shape[0], 4, dtype=torch.float32, device=x.device)
    v = x[:, :n_valid]
    m = v.amax(dim=1)
    stats[:, ce.MAX] = m
    stats[:, ce.SUM] = v.sum(dim=1)
    col, inside = ce._local_target(target, vocab_start, n_valid, ignore_index)
    xt = v.gather(1, col[:, None]).squeeze(1)
    stats[:, ce.TARGET] = torch.where(inside, xt, torch.zeros_like(xt))
    stats[:, ce.SUMEXP] = v.sub_(m[:, None]).exp_().sum(dim=1)
    return stats


def grad_(
    x: torch.Tensor,
    target: torch.Tensor,
    local: torch.Tensor,
    row_max: torch.Tensor,
    log_s: torch.Tensor,
    row_grad: torch.Tensor,
    *,
    vocab_start: int,
    n_valid: int,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    vocab_size: int,
) -> torch.Tensor:
    """d loss / d logits in place, from the chunk as ``stats_`` left it (``local``: its
    ``[C, 4]`` statistics). fp32: ``x`` holds ``e = exp(x − m)``, so ``p = e·exp(m − M − log S)``
    is one per-row scale; the true class is rewritten from the exact fp32 target logit, not
    from the buffer. Other dtypes: ``grad_logits_`` on the raw logits (fp32 temporaries)."""
    spec = dict(vocab_start=vocab_start, n_valid=n_valid, ignore_index=ignore_index)
    if x.dtype != torch.float32:
        return grad_logits_(
            x,
            target,
            row_max,
            log_s,
            row_grad,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            vocab_size=vocab_size,
            **spec,
        )
    x[:, n_valid:] = 0
    if n_valid <= 0 or x.shape[0] == 0:
        return x
    alpha, g = label_smoothing, row_grad.float()
    k = g * (1.0 + 2.0 * z_loss * (row_max + log_s))  # g·(1 + 2z·lse)
    v = x[:, :n_valid]
    v.mul_((k * torch.exp(local[:, ce.MAX] - row_max - log_s))[:, None])  # g·p·(1 + 2z·lse)
    if alpha:
        v.sub_((g * (alpha / vocab_size))[:, None])
    col, inside = ce._local_target(target, **spec)
    p_t = torch.exp(local[:, ce.TARGET] - row_max - log_s)
    d_t = k * p_t - g * (alpha / vocab_size) - (1.0 - alpha) * g
    keep = v.gather(1, col[:, None]).squeeze(1)
    v.scatter_(1, col[:, None], torch.where(inside, d_t, keep)[:, None])
    return x


@dataclass
class ChunkResult:
    """What ``chunk_loop`` computed: per-row fp32 ``loss``, ``row_max``, ``log_s`` ``[N]`` (None
    when the statistics were given), and the gradients (None unless asked for)."""

    loss: torch.Tensor | None
    row_max: torch.Tensor
    log_s: torch.Tensor
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None


def chunk_loop(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    n_valid: int,
    vocab_size: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    row_grad: torch.Tensor | None = None,
    stats: tuple[torch.Tensor, torch.Tensor] | None = None,
    hidden_grad: bool = True,
    weight_grad: bool = True,
    gather: Callable[[torch.Tensor, bool], torch.Tensor] = lambda stats, first: stats.unsqueeze(0),
    local_stats: Callable[..., torch.Tensor] | None = stats_,
    grad_fn: Callable[..., torch.Tensor] = grad_,
) -> ChunkResult:
    """The chunked loss (and gradients) of ``hidden @ weight.T`` against ``target``.

    hidden ``[N, H]``, weight ``[V_local, H]`` (this rank's shard: global ids
    ``vocab_start + j`` for ``j < n_valid``; the other rows are padding), target ``[N]`` int64.
    ``row_grad`` ``[N]`` fp32: the upstream gradient of each row's loss (0 on ignored rows);
    None computes no gradient. ``stats``: the combined ``(row_max, log_s)`` of an earlier pass
    (the recompute backward): no statistics and no ``gather`` then. ``gather(stats, first)``
    maps this rank's ``[C, 4]`` statistics to every rank's ``[tp, C, 4]``; ``first`` marks the
    first chunk. ``local_stats(x, t, vocab_start=, n_valid=, ignore_index=)`` gives a chunk's
    ``[C, 4]`` statistics and may transform the buffer (``stats_`` does; None: skip it, for a
    ``grad_fn`` that needs neither); ``grad_fn(x, t, local, row_max, log_s, row_grad, ...)``
    turns the buffer as ``local_stats`` left it into d loss / d logits in place: ``stats_`` /
    ``grad_`` here, the Triton launchers in the op. N = 0 still makes one (empty) gather.
    """
    n, _ = hidden.shape
    n_local = weight.shape[0]
    step = chunk_size or default_chunk_size(n, n_local)
    dev = hidden.device
    buf = torch.empty(min(step, n), n_local, dtype=hidden.dtype, device=dev)
    if stats is None:
        loss = torch.empty(n, dtype=torch.float32, device=dev)
        row_max = torch.empty(n, dtype=torch.float32, device=dev)
        log_s = torch.empty(n, dtype=torch.float32, device=dev)
    else:
        loss, (row_max, log_s) = None, stats
    want = row_grad is not None
    grad_hidden = torch.empty_like(hidden) if want and hidden_grad else None
    grad_weight = None
    if want and weight_grad:
        acc = weight.dtype if weight.dtype == torch.float32 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=dev)
    spec = dict(vocab_start=vocab_start, n_valid=n_valid, ignore_index=ignore_index)
    grad_spec = dict(spec, label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab_size)
    for start in range(0, max(n, 1), step):
        rows = slice(start, min(start + step, n))
        h, t = hidden[rows], target[rows]
        x = torch.mm(h, weight.t(), out=buf[: h.shape[0]])
        local = None if local_stats is None else local_stats(x, t, **spec)
        if stats is None:
            m, ls, xt, total = ce.combine_stats(gather(local, start == 0))
            row_max[rows], log_s[rows] = m, ls
            loss[rows] = ce.row_loss(
                m,
                ls,
                xt,
                total,
                t != ignore_index,
                label_smoothing=label_smoothing,
                z_loss=z_loss,
                vocab_size=vocab_size,
            )
        if not want or h.shape[0] == 0:
            continue
        d = grad_fn(x, t, local, row_max[rows], log_s[rows], row_grad[rows], **grad_spec)
        if grad_hidden is not None:
            torch.mm(d, weight, out=grad_hidden[rows])
        if grad_weight is None:
            continue
        if grad_weight.dtype == d.dtype:
            grad_weight.addmm_(d.t(), h)
        else:  # bf16 / fp16: this chunk's product in the weight's dtype, summed in fp32
            grad_weight.add_(torch.mm(d.t(), h))
    return ChunkResult(loss, row_max, log_s, grad_hidden, grad_weight)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-rank oracle: (loss, d loss / d hidden, d loss / d weight) for an upstream
    gradient of 1, chunked as the op does. hidden ``[N, H]``, weight ``[V, H]`` (rows past
    ``vocab_size`` are padding), target ``[N]``; loss as ``vocab_parallel_cross_entropy``."""
    n_local = weight.shape[0]
    vocab_size = n_local if vocab_size is None else vocab_size
    valid = target != ignore_index
    count = valid.sum().clamp(min=1).float()
    g = torch.ones_like(valid, dtype=torch.float32) if reduction != "mean" else 1.0 / count
    row_grad = torch.where(valid, g, torch.zeros((), device=valid.device))
    out = chunk_loop(
        hidden,
        weight,
        target,
        vocab_start=0,
        n_valid=min(n_local, vocab_size),
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        chunk_size=chunk_size,
        row_grad=row_grad,
    )
    loss = out.loss
    if reduction != "none":
        loss = loss.sum() / count if reduction == "mean" else loss.sum()
    return loss, out.grad_hidden, out.grad_weight.to(weight.dtype)
