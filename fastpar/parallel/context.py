"""Context parallelism: a long sequence split over the ``cp`` ranks, with ring attention.

Load-balanced layout (Megatron-Core's and torchtitan's for causal attention): the sequence of
length S is cut into 2·cp chunks of c = S / (2·cp) tokens; cp rank i holds chunks i and
2·cp − 1 − i, in that order (``local_positions``), so every rank has the same share of the
causal mask's work. ``split_sequence`` takes this rank's tokens of a [B, S, ...] tensor
(token ids, targets, positions); everything but attention then acts on the local 2c tokens.

``ring_attention(q, k, v, group)``: causal softmax attention of this rank's queries against the
keys and values of the whole sequence. q [B, Hq, 2c, D], k / v [B, Hkv, 2c, D] (grouped-query
attention when Hkv < Hq, Hq a multiple of Hkv), each rank's tokens in the layout above (apply
RoPE at ``local_positions`` before). Forward: cp steps; at step s the rank holds the K/V block
of rank (i − s) mod cp, posts its send to rank i + 1 and the receive of the next block from
rank i − 1 (the next transfer in flight while this block computes), and merges the block's
partial attention into the running output with the online softmax (running log-sum-exp,
fp32). Of the four (query chunk, key chunk) pairs of a step, a pair runs whole when the key
chunk is earlier, causally masked on the diagonal, and not at all when it is later. Saved for
backward: q, k, v, the output and the log-sum-exp (no S × S probabilities). Backward: the
same ring, each K/V block travelling with its dK / dV accumulators; after cp steps every block's
gradients are back on its owner (one more transfer). Exact: equal to full causal attention
within fp32 rounding. The group's timeout bounds every wait.

``measure_waits()``: a context manager whose dict collects the seconds ring attention spent
waiting for transfers (``wait_s``) and the transfers it waited for (``transfers``), for
benchmarks (how much of the K/V traffic the block compute hides).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from fastpar.comm import group_rank, group_size


def _chunks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions [2c] of the tokens cp rank ``rank`` holds (chunks i, 2cp−1−i)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism splits the sequence into 2*cp = {2 * cp} equal chunks: "
            f"seq_len {seq_len} is not divisible by {2 * cp}; use a multiple of {2 * cp}"
        )
    c = seq_len // (2 * cp)
    a, b = _chunks(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]).to(
        device
    )


def split_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of ``x`` (the whole sequence along ``dim``): chunks i and
    2cp − 1 − i, concatenated. A view-free gather; meant for ids, targets and positions
    (its gradient, if any, is scattered back into a zero tensor of the whole sequence)."""
    cp = group_size(group)
    if cp == 1:
        return x
    idx = local_positions(x.shape[dim], cp, group_rank(group), x.device)
    return x.index_select(dim, idx)


def _peers(group) -> tuple[int, int]:
    """Global ranks of the next and the previous cp rank on the ring."""
    cp, r = group_size(group), group_rank(group)
    nxt, prv = (r + 1) % cp, (r - 1) % cp
    if group is None:
        return nxt, prv
    return dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)


def _exchange(send: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Post ``send`` to the next rank and the receive of the same shape from the previous one;
    returns (the receive buffer, the works to wait)."""
    nxt, prv = _peers(group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return recv, dist.batch_isend_irecv(ops)


_WAITS: list[dict] = []


@contextlib.contextmanager
def measure_waits() -> Iterator[dict]:
    """Collect ring attention's transfer waits inside the block (module docstring)."""
    stats = {"wait_s": 0.0, "transfers": 0}
    _WAITS.append(stats)
    try:
        yield stats
    finally:
        _WAITS.remove(stats)


def _wait(works: list) -> None:
    t0 = time.perf_counter() if _WAITS else 0.0
    for w in works:
        w.wait()
    if _WAITS and works:
        for stats in _WAITS:
            stats["wait_s"] += time.perf_counter() - t0
            stats["transfers"] += 1


def _expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _pairs(cp: int, me: int, src: int):
    """(query chunk slot, key chunk slot, causal) for the pairs that see each other."""
    qa, ka = _chunks(cp, me), _chunks(cp, src)
    for i, a in enumerate(qa):
        for j, b in enumerate(ka):
            if b <= a:
                yield i, j, b == a


def _causal_mask(c: int, device) -> torch.Tensor:
    return torch.ones(c, c, dtype=torch.bool, device=device).tril()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale):
        cp, me = group_size(group), group_rank(group)
        b, hq, n, d = q.shape
        c, rep = n // 2, hq // k.shape[1]
        qf = q.float()
        out = torch.zeros(b, hq, n, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
        mask = _causal_mask(c, q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            works = []
            if step < cp - 1:
                nxt, works = _exchange(kv, group)
            src = (me - step) % cp
            kb, vb = (_expand(t, rep).float() for t in kv)
            for i, j, causal in _pairs(cp, me, src):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                s = torch.matmul(qf[:, :, qs], kb[:, :, ks].transpose(-1, -2)) * scale
                if causal:
                    s = s.masked_fill(~mask, float("-inf"))
                blk_lse = torch.logsumexp(s, dim=-1)
                blk = torch.matmul(torch.exp(s - blk_lse.unsqueeze(-1)), vb[:, :, ks])
                new = torch.logaddexp(lse[:, :, qs], blk_lse)
                out[:, :, qs] = out[:, :, qs] * torch.exp(lse[:, :, qs] - new).unsqueeze(-1) + (
                    blk * torch.exp(blk_lse - new).unsqueeze(-1)
                )
                lse[:, :, qs] = new
            _wait(works)
            if step < cp - 1:
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, me = group_size(group), group_rank(group)
        b, hq, n, d = q.shape
        hkv = k.shape[1]
        c, rep = n // 2, hq // hkv
        qf, do = q.float(), grad.float()
        delta = (do * out).sum(-1)  # [B, Hq, n]
        dq = torch.zeros_like(qf)
        mask = _causal_mask(c, q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(2, b, hkv, n, d, dtype=torch.float32, device=q.device)
        for step in range(cp):
            works = []
            if step < cp - 1:  # the next K/V block in flight during this block's compute
                nxt, works = _exchange(kv, group)
            src = (me - step) % cp
            kb, vb = (_expand(t, rep).float() for t in kv)
            dk = torch.zeros(b, hq, n, d, dtype=torch.float32, device=q.device)
            dv = torch.zeros_like(dk)
            for i, j, causal in _pairs(cp, me, src):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                s = torch.matmul(qf[:, :, qs], kb[:, :, ks].transpose(-1, -2)) * scale
                p = torch.exp(s - lse[:, :, qs].unsqueeze(-1))
                if causal:
                    p = p.masked_fill(~mask, 0.0)
                dv[:, :, ks] += torch.matmul(p.transpose(-1, -2), do[:, :, qs])
                dp = torch.matmul(do[:, :, qs], vb[:, :, ks].transpose(-1, -2))
                ds = p * (dp - delta[:, :, qs].unsqueeze(-1)) * scale
                dq[:, :, qs] += torch.matmul(ds, kb[:, :, ks])
                dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), qf[:, :, qs])
            if rep > 1:
                dk, dv = (t.view(b, hkv, rep, n, d).sum(2) for t in (dk, dv))
            dkv = dkv + torch.stack([dk, dv])
            _wait(works)
            if cp > 1:  # the accumulators follow their block to the next rank
                dkv, dworks = _exchange(dkv.contiguous(), group)
                _wait(dworks)
            if step < cp - 1:
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, scale: float | None = None
) -> torch.Tensor:
    """Causal attention over the sequence split on ``group`` (module docstring): q [B, Hq, 2c,
    D], k / v [B, Hkv, 2c, D] -> [B, Hq, 2c, D]. ``scale`` defaults to 1/sqrt(D)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"ring_attention takes q [B, Hq, T, D] and k, v [B, Hkv, T, D]; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(
            f"ring_attention: {q.shape[1]} query heads must be a multiple of {k.shape[1]} KV "
            f"heads and the {q.shape[2]} local tokens (two chunks) the keys' {k.shape[2]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, scale)
