"""Pure-torch vocab-parallel cross-entropy: the CPU path and the oracle of the Triton kernels.

Every function here is local to one rank (no communication); ``fastpar.ops.cross_entropy``
gathers the per-row statistics over the tensor-parallel group between ``local_stats`` and
``combine_stats``. Shapes: ``N`` rows (tokens), ``V_local`` columns (this rank's vocabulary
shard), of which the first ``n_valid`` are real vocabulary ids and the rest padding.

Statistics layout (fp32 ``[N, 4]``, one row per token): column ``MAX`` the row maximum over the
valid columns (-inf when the shard has none), ``SUMEXP`` the sum of ``exp(x - max)``, ``TARGET``
the target logit when the target falls in this shard (else 0), ``SUM`` the sum of the logits
(used by label smoothing).
"""

from __future__ import annotations

import torch

from fastpar.reference.precision import compute_dtype

MAX, SUMEXP, TARGET, SUM = 0, 1, 2, 3


def _local_target(
    target: torch.Tensor, vocab_start: int, n_valid: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of the target in this shard clamped into range ``[N]`` int64, in-shard mask ``[N]``)."""
    local = target - vocab_start
    inside = (target != ignore_index) & (local >= 0) & (local < n_valid)
    return local.clamp(0, max(n_valid - 1, 0)), inside


def local_stats(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, n_valid: int, ignore_index: int
) -> torch.Tensor:
    """Per-row statistics of one shard, fp32 ``[N, 4]`` (see the module docstring).

    ``logits`` ``[N, V_local]`` (any float dtype, accumulated in fp32; float64 in float64, the
    stats then float64 too); ``target`` ``[N]`` global ids; this shard holds global ids
    ``vocab_start + j`` for ``j < n_valid``.
    """
    n, acc = logits.shape[0], compute_dtype(logits.dtype)
    stats = torch.zeros(n, 4, dtype=acc, device=logits.device)
    if n_valid <= 0:
        stats[:, MAX] = float("-inf")
        return stats
    x = logits[:, :n_valid]
    m = x.amax(dim=1).to(acc)
    stats[:, MAX] = m
    for rows in _row_chunks(n, n_valid):  # exp(x - m) in a small reused buffer, not [N, V]
        buf = torch.sub(x[rows].to(acc), m[rows, None])
        stats[rows, SUMEXP] = buf.exp_().sum(dim=1)
    stats[:, SUM] = x.sum(dim=1, dtype=acc)
    col, inside = _local_target(target, vocab_start, n_valid, ignore_index)
    xt = x.gather(1, col[:, None]).squeeze(1).to(acc)
    stats[:, TARGET] = torch.where(inside, xt, torch.zeros_like(xt))
    return stats


def _row_chunks(n: int, cols: int, elements: int = 1 << 20) -> list[slice]:
    """Row slices of about ``elements`` elements each (bounds the fp32 temporaries)."""
    step = max(1, elements // max(cols, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def combine_stats(
    gathered: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge the statistics of every shard: ``[tp, N, 4]`` → (max, log-sum, target logit, sum).

    Each ``[N]`` fp32: ``M = max_r m_r``, ``log S = log(sum_r s_r * exp(m_r - M))`` (so that
    ``lse = M + log S``; kept apart because ``x - M - log S`` is exact where ``x - lse`` would
    lose digits for large logits), the target logit and the logit sum added over the shards.
    """
    m = gathered[..., MAX]
    big = m.amax(dim=0)
    log_s = torch.log((gathered[..., SUMEXP] * torch.exp(m - big)).sum(dim=0))
    return big, log_s, gathered[..., TARGET].sum(dim=0), gathered[..., SUM].sum(dim=0)


def row_loss(
    row_max: torch.Tensor,
    log_s: torch.Tensor,
    target_logit: torch.Tensor,
    logit_sum: torch.Tensor,
    valid: torch.Tensor,
    *,
    label_smoothing: float,
    z_loss: float,
    vocab_size: int,
) -> torch.Tensor:
    """Per-row fp32 loss ``[N]``: ``lse − (1−α)·x_t − (α/V)·Σx + z·lse²``, 0 where not ``valid``.

    ``lse = row_max + log_s``; the max is subtracted first so logits of ±1e4 keep their digits.
    """
    alpha = label_smoothing
    loss = row_max - (1.0 - alpha) * target_logit
    if alpha:
        loss = loss - (alpha / vocab_size) * logit_sum
    loss = loss + log_s
    if z_loss:
        lse = row_max + log_s
        loss = loss + z_loss * lse * lse
    return torch.where(valid, loss, torch.zeros_like(loss))


def grad_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
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
    in_place: bool = False,
) -> torch.Tensor:
    """d loss / d logits for one shard, ``[N, V_local]`` in the logits' dtype.

    ``row_max``, ``log_s`` ``[N]`` fp32 from ``combine_stats``; ``row_grad`` ``[N]`` fp32 is the
    upstream gradient of each row's loss (0 for ignored rows):
    ``grad_j = g·(p_j·(1 + 2z·lse) − (1−α)·[j = t] − α/V)`` on valid columns, 0 on padding,
    with ``p_j = exp(x_j − M − log S)``.
    Everything, the true-class term included, is computed in fp32 and cast once at the end.
    ``in_place``: written into ``logits`` itself, which is returned (temporaries: fp32 blocks
    of about 2^20 elements).
    """
    grad = logits if in_place else torch.empty_like(logits, memory_format=torch.contiguous_format)
    grad[:, n_valid:] = 0
    if n_valid <= 0:
        return grad
    alpha = label_smoothing
    acc = compute_dtype(logits.dtype)
    g = row_grad.to(acc)
    scale = (g * (1.0 + 2.0 * z_loss * (row_max + log_s)))[:, None]
    shift = (g * (alpha / vocab_size))[:, None]
    col, inside = _local_target(target, vocab_start, n_valid, ignore_index)
    onehot = torch.where(inside, -(1.0 - alpha) * g, torch.zeros_like(g))[:, None]
    for rows in _row_chunks(logits.shape[0], n_valid):
        d = torch.sub(logits[rows, :n_valid].to(acc), row_max[rows, None])
        d.sub_(log_s[rows, None]).exp_().mul_(scale[rows])  # g·p·(1 + 2z·lse)
        if alpha:
            d.sub_(shift[rows])
        d.scatter_add_(1, col[rows, None], onehot[rows])  # true class, still in fp32
        grad[rows, :n_valid] = d  # the single cast to the logits' dtype
    return grad
