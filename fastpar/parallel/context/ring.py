"""Ring attention for context parallelism (``ring_attention``): each rank keeps its chunks of
the queries while the keys and values go round the ``cp`` ranks, exact and stopping at packed
documents' boundaries; ``measure_waits`` times the ring's waits. The layout, the ring, the
document blocks: docs/context.md ("Inside fastpar.parallel.context"), whose package re-exports
``ring_attention`` and ``measure_waits``."""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastpar.comm import group_rank, group_size, plain
from fastpar.comm.sequence import check_doc_ids, rank_chunks


def _peers(group) -> tuple[int, int]:
    """Global ranks of the next and the previous cp rank on the ring."""
    cp, r = group_size(group), group_rank(group)
    nxt, prv = (r + 1) % cp, (r - 1) % cp
    if group is None:
        return nxt, prv
    return dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)


def _post(send: torch.Tensor, recv: torch.Tensor, group, tag: int) -> list:
    nxt, prv = _peers(group)
    return plain.exchange(send, recv, nxt, prv, group, tag)


def _transfer(send: torch.Tensor, recv: torch.Tensor, group, tag: int) -> None:
    for w in _post(send, recv, group, tag):
        w.wait()


_SENDER: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def _sender() -> concurrent.futures.ThreadPoolExecutor:
    """The one background thread (of this process: a forked child makes its own) that runs
    CPU (gloo) transfers, in the order posted."""
    pid = os.getpid()
    if pid not in _SENDER:
        _SENDER.clear()
        _SENDER[pid] = concurrent.futures.ThreadPoolExecutor(1, "fastpar-ring")
    return _SENDER[pid]


def _exchange(send: torch.Tensor, group, tag: int = 0) -> tuple[torch.Tensor, list]:
    """Post ``send`` to the next rank and the receive of the same shape from the previous one;
    returns (the receive buffer, the works to wait). On a CPU the pair runs on a background
    thread: gloo writes a message inside the send call once the peer's receive is posted, so
    posted from the computing thread it would not overlap the compute (measured: 2.6 ms a
    512 KiB send inline). NCCL's sends are asynchronous already."""
    recv = torch.empty_like(send)
    if send.device.type != "cpu":
        return recv, _post(send, recv, group, tag)
    return recv, [_sender().submit(_transfer, send, recv, group, tag)]


_WAITS: list[dict] = []


@contextlib.contextmanager
def measure_waits() -> Iterator[dict]:
    """Collect ring attention's transfer waits inside the block (docs/context.md)."""
    stats = {
        "wait_s": 0.0,
        "transfers": 0,
        "blocks_total": 0,
        "blocks_skipped": 0,
        "blocks_masked": 0,
    }
    _WAITS.append(stats)
    try:
        yield stats
    finally:
        _WAITS.remove(stats)


def _wait(works: list) -> None:
    """Wait for ``works`` (torch Works, or futures of background transfers: their waits are
    bounded by the group's timeout, whose error they re-raise here)."""
    t0 = time.perf_counter() if _WAITS else 0.0
    for w in works:
        if isinstance(w, concurrent.futures.Future):
            w.result()
        else:
            w.wait()
    if _WAITS and works:
        for stats in _WAITS:
            stats["wait_s"] += time.perf_counter() - t0
            stats["transfers"] += 1


def _pairs(cp: int, me: int, src: int):
    """(query chunk slot, key chunk slot, causal) for the pairs that see each other."""
    qa, ka = rank_chunks(cp, me), rank_chunks(cp, src)
    for i, a in enumerate(qa):
        for j, b in enumerate(ka):
            if b <= a:
                yield i, j, b == a


def _causal_mask(c: int, device) -> torch.Tensor:
    return torch.ones(c, c, dtype=torch.bool, device=device).tril()


SKIP, PLAIN, MASKED = "skip", "plain", "masked"


def _chunk_ends(doc_ids: torch.Tensor, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and the last document id [B, 2cp] of every chunk of the whole rows, on the
    host (one small device-to-host copy)."""
    b, s = doc_ids.shape
    chunks = doc_ids.detach().reshape(b, 2 * cp, s // (2 * cp))
    ends = torch.stack([chunks[:, :, 0], chunks[:, :, -1]]).to("cpu")
    return ends[0], ends[1]


def _block_kind(ends, a: int, b: int) -> str:
    """The class of the block of query chunk ``a`` and key chunk ``b`` <= a (module
    docstring): ``ends`` = (first ids, last ids) [B, 2cp], or None (no documents: plain)."""
    if ends is None:
        return PLAIN
    first, last = ends
    if b < a and not bool((last[:, b] == first[:, a]).any()):
        return SKIP  # every key's id < every query's id, in every row
    if bool((first[:, b] == last[:, a]).all()):
        return PLAIN  # both chunks one document in every row
    return MASKED


def _document_mask(doc_ids: torch.Tensor, a: int, b: int, c: int) -> torch.Tensor:
    """[B, 1, c, c] bool: query t of chunk ``a`` sees key u of chunk ``b`` (same document, and
    u <= t on the diagonal)."""
    qid, kid = doc_ids[:, a * c : (a + 1) * c], doc_ids[:, b * c : (b + 1) * c]
    mask = qid[:, :, None] == kid[:, None, :]
    if a == b:
        mask = mask & _causal_mask(c, doc_ids.device)
    return mask[:, None]


def _plan(cp: int, me: int, src: int, ends, doc_ids, c: int, count: bool = False):
    """(query chunk slot, key chunk slot, causal, mask or None) of the blocks to compute
    between this rank's queries and rank ``src``'s keys: ``_pairs`` less the skipped blocks,
    with a document mask where one is needed. ``count``: add the blocks to ``measure_waits``."""
    qa, ka = rank_chunks(cp, me), rank_chunks(cp, src)
    for i, j, causal in _pairs(cp, me, src):
        kind = _block_kind(ends, qa[i], ka[j])
        if count:
            for stats in _WAITS:
                stats["blocks_total"] += 1
                stats["blocks_skipped"] += kind == SKIP
                stats["blocks_masked"] += kind == MASKED
        if kind == SKIP:
            continue
        if kind == MASKED:
            yield i, j, False, _document_mask(doc_ids, qa[i], ka[j], c)
        else:
            yield i, j, causal, None


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the flash kernels' additive one (0 seen, −inf not)."""
    zero = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zero.masked_fill(~mask, float("-inf"))


_CPU_FLASH = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)


def _flash_cpu(q: torch.Tensor) -> bool:
    """Whether the block runs torch's CPU flash-attention kernels (fp32 / bf16 on a CPU): they
    return the log-sum-exp the merge needs and take it back in backward."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and all(hasattr(torch.ops.aten, name) for name in _CPU_FLASH)
    )


def _pad(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` [..., D] with zeros to [..., d] (contiguous): the CPU flash kernels need one head
    dim for q, k and v; zero columns leave every score and output column exactly as they were
    and get gradients that are dropped."""
    return x.contiguous() if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


def _block_forward(q, k, v, causal: bool, scale: float, mask=None):
    """One (query chunk, key chunk) block: (output [B, H, c, Dv] fp32, lse [B, H, c] fp32).
    ``mask`` [B, 1, c, c] bool (documents): the keys each query sees; a query that sees none
    gets output 0 and lse −inf. q / k head dim D and v's Dv may differ."""
    if _flash_cpu(q):
        extra = {} if mask is None else {"attn_mask": _additive(mask, q.dtype)}
        d, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad(q, d), _pad(k, d), _pad(v, d), 0.0, causal, scale=scale, **extra
        )
        out, lse = out[..., :dv].float(), lse.float()
        if mask is not None:  # the kernel reports lse 0 (output 0) for a row that sees nothing
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(s.shape[-1], s.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # exp(−inf − 0) = 0, not NaN
    return torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v.float()), lse


def _block_backward(do, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """(dq, dk, dv) of one block given the WHOLE attention's output and log-sum-exp (so the
    block's probabilities are the final ones; finite: every query sees itself): fp32.
    ``mask`` as ``_block_forward``'s (p = 0 where a query does not see a key)."""
    if _flash_cpu(q):
        extra = {} if mask is None else {"attn_mask": _additive(mask, q.dtype)}
        d = max(q.shape[-1], v.shape[-1])
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad(do.to(q.dtype), d),
            _pad(q, d),
            _pad(k, d),
            _pad(v, d),
            _pad(out.to(q.dtype), d),
            lse.contiguous(),
            0.0,
            causal,
            scale=scale,
            **extra,
        )
        dims = (q.shape[-1], k.shape[-1], v.shape[-1])
        return tuple(g[..., :n].float() for g, n in zip(grads, dims, strict=True))
    qf, kf, vf, do = q.float(), k.float(), v.float(), do.float()
    p = torch.exp(torch.matmul(qf, kf.transpose(-1, -2)) * scale - lse.unsqueeze(-1))
    if causal:
        p = p.masked_fill(~_causal_mask(p.shape[-1], p.device), 0.0)
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do)
    delta = (do * out).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta) * scale
    return torch.matmul(ds, kf), torch.matmul(ds.transpose(-1, -2), qf), dv


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V (head dims D and Dv, equal or not) in one flat buffer: one transfer a step."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(kv: torch.Tensor, kshape, vshape) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of K [kshape] and V [vshape] in a buffer of ``_pack``'s layout."""
    nk = math.prod(kshape)
    return kv[:nk].view(kshape), kv[nk:].view(vshape)


def _ring_blocks(kv: torch.Tensor, shapes, group, rep: int):
    """Yield (source rank, K, V with heads repeated ``rep`` times) of every rank's K/V block
    (``_pack``'s buffer of K and V of ``shapes``) in ring order, own first; the next block is
    in flight while the caller computes on the current one."""
    cp, me = group_size(group), group_rank(group)
    for step in range(cp):
        works = []
        if step < cp - 1:
            nxt, works = _exchange(kv, group)
        kb, vb = (t if rep == 1 else t.repeat_interleave(rep, dim=1) for t in _unpack(kv, *shapes))
        yield (me - step) % cp, kb, vb
        _wait(works)
        if step < cp - 1:
            kv = nxt


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, doc_ids):
        cp, me = group_size(group), group_rank(group)
        b, hq, n, _ = q.shape
        c, rep = n // 2, hq // k.shape[1]
        ends = None if doc_ids is None else _chunk_ends(doc_ids, cp)
        out = torch.zeros(b, hq, n, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
        shapes = (k.shape, v.shape)
        for src, kb, vb in _ring_blocks(_pack(k, v), shapes, group, rep):
            for i, j, causal, mask in _plan(cp, me, src, ends, doc_ids, c, count=True):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                blk, blk_lse = _block_forward(
                    q[:, :, qs], kb[:, :, ks], vb[:, :, ks], causal, scale, mask
                )
                old = lse[:, :, qs]
                new = torch.logaddexp(old, blk_lse)
                # −inf where no block so far had a key for the query: weights 0, not NaN
                safe = new.masked_fill(new == float("-inf"), 0.0)
                out[:, :, qs] = out[:, :, qs] * torch.exp(old - safe).unsqueeze(-1) + (
                    blk * torch.exp(blk_lse - safe).unsqueeze(-1)
                )
                lse[:, :, qs] = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.doc_ids, ctx.ends = group, scale, doc_ids, ends
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, doc_ids, ends = ctx.group, ctx.scale, ctx.doc_ids, ctx.ends
        cp, me = group_size(group), group_rank(group)
        b, hq, n, _ = q.shape
        hkv = k.shape[1]
        c, rep = n // 2, hq // hkv
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        incoming = None  # (buffer, works): the dK/dV accumulator of the block computed next
        shapes = (k.shape, v.shape)
        for src, kb, vb in _ring_blocks(_pack(k, v), shapes, group, rep):
            dkv = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=q.device)
            for i, j, causal, mask in _plan(cp, me, src, ends, doc_ids, c):
                qs, ks = slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)
                gq, gk, gv = _block_backward(
                    grad[:, :, qs],
                    q[:, :, qs],
                    kb[:, :, ks],
                    vb[:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                    causal,
                    scale,
                    mask,
                )
                dq[:, :, qs] += gq
                for acc, g in zip(_unpack(dkv, *shapes), (gk, gv), strict=True):  # in place
                    if rep > 1:  # query heads j·rep .. j·rep + rep - 1 share K/V head j
                        g = g.view(b, hkv, rep, c, g.shape[-1]).sum(2)
                    acc[:, :, ks] += g
            if incoming is not None:  # the previous ranks' share of this block, arrived meanwhile
                _wait(incoming[1])
                dkv += incoming[0]
            if cp > 1:  # on to the next rank, in flight during its next block's compute
                incoming = (*_exchange(dkv, group, tag=1), dkv)
        if incoming is not None:  # every rank's share of this rank's own block
            _wait(incoming[1])
            dkv = incoming[0]
        dk, dv = _unpack(dkv, *shapes)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    *,
    scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the sequence split on ``group`` (docs/context.md): q [B, Hq, 2c,
    D], k [B, Hkv, 2c, D], v [B, Hkv, 2c, Dv] (Dv may differ from D, as in latent attention)
    -> [B, Hq, 2c, Dv]. ``scale`` (the softmax scale) defaults to 1/sqrt(D). ``doc_ids`` [B, S]
    (the whole rows' document ids, S = cp · 2c, non-decreasing per row): attention stops at
    documents, blocks no query sees are skipped (docs/context.md)."""
    dims_ok = q.dim() == k.dim() == v.dim() == 4 and q.shape[-1] == k.shape[-1]
    if not dims_ok or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"ring_attention takes q [B, Hq, T, D], k [B, Hkv, T, D] and v [B, Hkv, T, Dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(
            f"ring_attention: {q.shape[1]} query heads must be a multiple of {k.shape[1]} KV "
            f"heads and the {q.shape[2]} local tokens (two chunks) the keys' {k.shape[2]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if doc_ids is not None:
        doc_ids = check_doc_ids(doc_ids, q, group_size(group), "ring_attention")
    return _ring_eager()(q, k, v, group, scale, doc_ids)


_EAGER: list = []


def _ring_eager():
    """``_RingAttention.apply`` under ``torch.compiler.disable`` (one graph break inside a
    compiled block: its host-side ring and background transfers are not traceable), wrapped
    at first use so that ``import fastpar`` does not import torch._dynamo."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_RingAttention.apply))
    return _EAGER[0]
