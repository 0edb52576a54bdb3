"""``MoE``: a drop-in mixture-of-experts replacement for a transformer MLP block, with expert
parallelism over the mesh's EP group.

    moe = MoE(hidden_size=512, ffn_hidden_size=2048, num_experts=8, top_k=2, mesh=mesh)
    y = moe(x)                         # [..., H] -> [..., H]; the aux loss joins backward by itself

One forward, capacity against dropless mode and the weights' initialisation: docs/moe.md
("Inside the layer")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar.comm import (
    all_reduce_grad,
    all_to_all,
    copy_to_region,
    gather_from_sequence,
    group_rank,
    group_size,
    plain,
    reduce_from_region,
    scatter_to_sequence,
)
from fastpar.comm.sequence import split_sequence
from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_blocks, mark_expert, mark_sharded
from fastpar.moe import experts, fp8_experts, tp
from fastpar.moe.aux_grad import InjectAuxGrad, block_scale
from fastpar.moe.aux_grad import aux_loss_scale as aux_loss_scale
from fastpar.moe.aux_grad import current_aux_loss_scale as current_aux_loss_scale
from fastpar.moe.config import ExpertConfig, RouterConfig, with_options
from fastpar.moe.dispatch import ep_combine, ep_dispatch
from fastpar.moe.experts import SharedExperts, init_experts
from fastpar.moe.overlap import CapacityChunks, DroplessChunks, OverlappedExperts
from fastpar.moe.router import TopKRouter
from fastpar.ops.documents import current
from fastpar.ops.moe_permute import moe_permute, moe_unpermute
from fastpar.reference.precision import upcast

EAGER_ONLY = ("_check_same_capacity", "_dropless_overlapped")
"""MoE methods run eagerly inside a compiled model (``torch.compiler.disable``): the capacity
check's host reads of an all-gather, and the overlapped dropless path's host-built chunks; each
is one isolated graph break."""


def _eager_only_once() -> None:
    """Wrap ``EAGER_ONLY`` in ``torch.compiler.disable`` when the first MoE is built. Applying it
    at import would import torch._dynamo, and with it Triton, on ``import fastpar``."""
    if getattr(MoE, "_eager_only_done", False):
        return
    for name in EAGER_ONLY:
        setattr(MoE, name, torch.compiler.disable(getattr(MoE, name)))
    MoE._eager_only_done = True


class MoE(nn.Module):
    """Mixture of experts over ``num_experts`` two-layer MLPs (H -> F -> H): ``x [..., H]``
    -> ``[..., H]``.

    The experts' kind, activation, biases and shared expert are ``experts=ExpertConfig(...)``,
    the router's options ``router=RouterConfig(...)`` (``fastpar.moe.config``); their fields
    may also be given as keywords (``expert="swiglu"``, ``score="sigmoid"``), which replace the
    configs'. Parameters: ``w1`` [E_local, H, F] (gated: [E_local, H, 2F], gate | up), ``w2``
    [E_local, F, H], with ``bias`` ``b1`` [E_local, F or 2F], ``b2`` [E_local, H]; ``shared``
    and ``shared_gate`` (dense). ``mesh`` (its ep, tp and cp groups) or ``ep_group`` /
    ``tp_group`` / ``cp_group`` (None: none of that parallelism); ``expert_tp``,
    ``sequence_parallel`` and ``sequence_dim`` pick the layout at TP > 1 (``fastpar.moe.tp``);
    ``overlap_chunks`` K > 1 overlaps the all-to-alls with the experts (``fastpar.moe.overlap``).
    The auxiliary loss reaches backward by itself, weighted by ``aux_loss_scale``
    (``aux_loss_in_backward=False``: the caller adds ``moe_aux_loss(model)``). All of it:
    docs/moe.md ("Inside the layer"). After a forward: ``aux_loss`` (load balancing + z-loss)
    and ``stats`` (device tensors: ``counts`` [E] routed per expert, ``num_dropped``).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        *,
        router: RouterConfig | None = None,
        experts: ExpertConfig | None = None,
        overlap_chunks: int = 1,
        aux_loss_in_backward: bool = True,
        sequence_parallel: bool = False,
        expert_tp: bool = False,
        sequence_dim: int = 1,
        mesh: ParallelMesh | DeviceMesh | None = None,
        ep_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        cp_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
        **options,
    ) -> None:
        super().__init__()
        _eager_only_once()
        router, kinds = with_options(router, experts, options)
        capacity_factor = router.capacity_factor
        if mesh is not None and (ep_group, tp_group, cp_group) != (None, None, None):
            raise ValueError("pass either mesh= or ep_group= / tp_group= / cp_group=, not both")
        if mesh is not None:  # converted once (a DeviceMesh: no context parallelism)
            ep_group, tp_group = as_group(mesh, "ep"), as_group(mesh, "tp")
            cp_group = getattr(mesh, "context_group", None)
        self.ep_group, self.tp_group, self.cp_group = ep_group, tp_group, cp_group
        self.ep = group_size(ep_group) if ep_group is not None else 1
        self.tp = group_size(tp_group) if tp_group is not None else 1
        self.cp = group_size(cp_group) if cp_group is not None else 1
        self.tp_layout = tp.layout_of(self.tp, sequence_parallel, expert_tp)
        tp.check(self.tp_layout, self.tp, ffn_hidden_size, capacity_factor, overlap_chunks)
        self.sequence_parallel, self.expert_tp = sequence_parallel, expert_tp
        self.sequence_dim = sequence_dim
        if self.cp > 1 and capacity_factor is not None:
            raise ValueError(
                f"MoE under context parallelism (cp={self.cp}) routes each rank's chunks of the "
                f"sequence; capacity_factor={capacity_factor} would drop per chunk, other tokens "
                "than the single-process layer: use dropless routing (capacity_factor=None)"
            )
        if num_experts % self.ep:
            raise ValueError(
                f"num_experts {num_experts} is not divisible by the expert-parallel size {self.ep}; "
                f"use a number of experts that is a multiple of {self.ep}"
            )
        if not isinstance(overlap_chunks, int) or overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be a positive integer, got {overlap_chunks!r}")
        self.overlap_chunks = overlap_chunks
        self.gated, activation, bias = kinds.resolved()
        shared_ffn_hidden_size, self.expert_config = kinds.shared_ffn_hidden_size, kinds
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local = num_experts // self.ep
        self.expert, self.activation, self.bias = kinds.expert, activation, bias
        self.shared_ffn_hidden_size = shared_ffn_hidden_size
        self.router = TopKRouter(hidden_size, num_experts, top_k, router=router, device=device)
        full = init_experts(
            num_experts, hidden_size, ffn_hidden_size, self.gated, bias, device, dtype
        )
        lo = group_rank(self.ep_group) * self.num_local if self.ep > 1 else 0
        sl = slice(lo, lo + self.num_local)
        # matrices stored transposed for x @ w: w1 [E_local, H, F or 2F], w2 [E_local, F, H]
        w1, w2 = full["w1"][sl].transpose(1, 2), full["w2"][sl].transpose(1, 2)
        b1 = full["b1"][sl] if "b1" in full else None
        if self.tp_layout == "expert_tp":  # F split over TP (``fastpar.moe.tp``)
            r, n = group_rank(self.tp_group), self.tp
            w1, w2 = tp.shard_ffn(w1, 2, r, n, self.gated), tp.shard_ffn(w2, 1, r, n, False)
            b1 = None if b1 is None else tp.shard_ffn(b1, 1, r, n, self.gated)
        self.w1 = nn.Parameter(w1.contiguous())
        self.b1 = nn.Parameter(b1.clone()) if b1 is not None else None
        self.w2 = nn.Parameter(w2.contiguous())
        self.b2 = nn.Parameter(full["b2"][sl].clone()) if "b2" in full else None
        for p in self._expert_params():
            mark_expert(p, self.ep_group if self.ep > 1 else None, num_experts)
        if self.gated:  # gate | up: two matrices for Muon
            mark_blocks(self.w1, 2, (ffn_hidden_size, ffn_hidden_size))
        if self.tp_layout == "expert_tp":
            width, fused = (2, 2) if self.gated else (1, 1)
            mark_sharded(self.w1, 2, self.tp_group, width * ffn_hidden_size, fused)
            mark_sharded(self.w2, 1, self.tp_group, ffn_hidden_size)
            if self.b1 is not None:
                mark_sharded(self.b1, 1, self.tp_group, width * ffn_hidden_size, fused)
        # shared experts: dense (the same on every EP and TP rank), drawn after the routed ones
        self.shared = self.shared_gate = None
        if shared_ffn_hidden_size is not None:
            self.shared = SharedExperts(
                hidden_size, shared_ffn_hidden_size, self.gated, activation, bias, device, dtype
            )
            if kinds.shared_gate:
                self.shared_gate = nn.Linear(hidden_size, 1, bias=False, device=device, dtype=dtype)
        self.aux_loss: torch.Tensor | None = None
        # Set by a training loop, or by ``aux_loss_scale(...)`` around the forward (the
        # pipeline engine does): the aux loss then enters backward through this layer's output,
        # scaled like the main loss (1 / micro-batches, times the loss scale), so a stage needs
        # no access to the final loss. This layer's own value, when set, wins.
        self.aux_loss_scale: float | torch.Tensor | None = None
        self.aux_loss_in_backward = aux_loss_in_backward
        self.stats: dict[str, torch.Tensor] = {}
        self._capacity_checked = False
        if self.tp_layout == "sequence":  # every parameter sees this rank's tokens only
            self.router.token_group = self.tp_group
            for p in self.parameters():
                all_reduce_grad(p, self.tp_group)
        if self.cp > 1:  # a sequence's tokens lie on every cp (and, routed locally, tp) rank
            local = self.tp_layout == "sequence"
            if local and not hasattr(mesh, "tp_cp_group"):
                raise ValueError(
                    "MoE routing a sequence-parallel chunk under context parallelism needs the "
                    "tp x cp token group: pass mesh= (a ParallelMesh) instead of the groups"
                )
            self.router.token_group = mesh.tp_cp_group if local else self.cp_group

    # The pipeline's protocols (fastpar.parallel.pipeline.protocols): the engine weighs the aux
    # loss by this context around its forwards; a recomputation keeps aux_loss and stats.
    aux_loss_weight = staticmethod(aux_loss_scale)

    @contextlib.contextmanager
    def keep_forward_state(self) -> Iterator[None]:
        """Around a recomputation: ``aux_loss`` and ``stats`` put back as they were before."""
        aux, stats = self.aux_loss, self.stats
        try:
            yield
        finally:
            self.aux_loss, self.stats = aux, stats

    def _expert_params(self) -> tuple[nn.Parameter, ...]:
        return tuple(p for p in (self.w1, self.b1, self.w2, self.b2) if p is not None)

    # -- expert compute ---------------------------------------------------------------------
    fp8 = None
    """An ``Fp8Use``: the routed experts' GEMMs in fp8 (``fastpar.moe.fp8_experts``, set by
    ``fastpar.nn.use_fp8``); None: in the parameters' precision."""

    def _run(self, batched: bool):
        """``experts.batched`` / ``segments``, or their fp8 forms when ``self.fp8`` is set."""
        if self.fp8 is None:
            return experts.batched if batched else experts.segments
        f = fp8_experts.plan(self.fp8, self.tp_group if self.tp_layout == "expert_tp" else None)
        run = fp8_experts.batched if batched else fp8_experts.segments
        return lambda *args: run(*args, f)

    def _hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The first matrix's output [..., F or 2F] -> the second's input [..., F]."""
        return experts.hidden(h, self.gated, self.activation)

    def _experts_batched(self, x: torch.Tensor) -> torch.Tensor:
        """x [E_local, N, H] -> [E_local, N, H] (expert TP: ``fastpar.moe.tp``)."""
        if self.tp_layout != "expert_tp":
            w = (self.w1, self.b1, self.w2, self.b2)
            return self._run(True)(x, *w, self.gated, self.activation)
        x = copy_to_region(x, self.tp_group)  # rows entering TP-split experts
        out = self._run(True)(x, self.w1, self.b1, self.w2, None, self.gated, self.activation)
        out = reduce_from_region(out, self.tp_group)  # the second matmul's partial sums
        return out if self.b2 is None else out + self.b2.unsqueeze(1)

    def _experts_segments(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """x [N, H] grouped by local expert with ``counts`` [E_local] rows each -> [N, H]
        (``fastpar.moe.experts.segments``: one grouped matmul per weight by default)."""
        if self.tp_layout != "expert_tp":
            w = (self.w1, self.b1, self.w2, self.b2)
            return self._run(False)(x, counts, *w, self.gated, self.activation)
        x = copy_to_region(x, self.tp_group)
        w = (self.w1, self.b1, self.w2, None)
        out = self._run(False)(x, counts, *w, self.gated, self.activation)
        out = reduce_from_region(out, self.tp_group)
        return tp.add_row_bias(out, self.b2, counts)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``. ``valid`` (bool, ``x.shape[:-1]``: this rank's
        tokens, as ``x`` is laid out): the tokens whose targets are valid, the only ones the aux
        losses and expert-bias counts count (``fastpar.moe.router``); None: the running
        ``Documents.valid`` (``fastpar.models.documents``) if set, else every token."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE expects input [..., {self.hidden_size}], got {tuple(x.shape)}")
        gather = self.tp_layout == "expert_tp" and self.sequence_parallel
        if valid is not None:
            valid = self._own_valid(x, valid, gather)
        else:
            valid = self._documents_valid(x, gather)
        if gather:
            x = gather_from_sequence(x, self.tp_group, self.sequence_dim)
            y = self._forward(x, valid)
            return scatter_to_sequence(y, self.tp_group, self.sequence_dim)
        return self._forward(x, valid)

    def _own_valid(self, x: torch.Tensor, valid: torch.Tensor, gather: bool) -> torch.Tensor:
        """An explicit ``valid`` over ``x``'s tokens -> over the routed tokens [T] (gathered
        over TP like ``x`` when the layer gathers the sequence)."""
        if valid.dtype != torch.bool or valid.shape != x.shape[:-1]:
            raise ValueError(
                f"MoE valid= must be a bool mask over the input's tokens {tuple(x.shape[:-1])}, "
                f"got {valid.dtype} {tuple(valid.shape)}"
            )
        valid = valid.to(x.device)
        if gather:
            dim = self.sequence_dim % x.dim()
            if dim == x.dim() - 1:
                raise ValueError(f"sequence_dim {self.sequence_dim} is the hidden dim of x")
            flags = gather_from_sequence(valid.to(torch.float32), self.tp_group, dim)
            valid = flags > 0.5
        return valid.reshape(-1)

    def _documents_valid(self, x: torch.Tensor, gather: bool) -> torch.Tensor | None:
        """The running ``Documents.valid`` [B, S] (whole rows) -> a mask [T] over the tokens
        this layer routes: this cp rank's chunks (``split_sequence``), then, when the tokens
        are split over TP (sequence-parallel tokens, not gathered here), this TP rank's
        contiguous chunk of them along ``sequence_dim``, as ``scatter_to_sequence`` splits the
        activations. A layout the mask cannot follow exactly is a ValueError."""
        docs = current()
        valid = None if docs is None else getattr(docs, "valid", None)
        if valid is None:
            return None
        valid = valid.to(x.device)
        if self.cp > 1:
            valid = split_sequence(valid, self.cp_group, dim=1)
        split = self.tp_layout == "sequence"  # each TP rank routes its own chunk
        if x.dim() == 3 and self.sequence_dim % 3 in (0, 1):
            if self.sequence_dim % 3 == 0:  # sequence-first [S, B, H]
                valid = valid.t()
            if split:
                dim = self.sequence_dim % 3
                if valid.shape[dim] % self.tp:
                    raise ValueError(
                        f"Documents.valid {tuple(valid.shape)} cannot be split over tp={self.tp} "
                        f"along dim {dim} like the activations {tuple(x.shape)}"
                    )
                valid = valid.chunk(self.tp, dim)[group_rank(self.tp_group)]
        elif x.dim() == 2 and self.cp == 1 and not split and not gather:
            valid = valid.reshape(-1)  # tokens [B·S, H], batch-first rows flattened
        else:
            raise ValueError(
                f"MoE cannot line Documents.valid {tuple(valid.shape)} up with its input "
                f"{tuple(x.shape)} (sequence_dim={self.sequence_dim}, tp layout "
                f"{self.tp_layout!r}, cp={self.cp}): pass [B, S, H] batch-first, or the mask "
                "over the input's tokens as MoE(x, valid=)"
            )
        want = list(x.shape[:-1])
        if gather:  # the layer routes the sequence gathered over TP
            want[self.sequence_dim % x.dim()] *= self.tp
        want = torch.Size(want)
        if valid.shape != want:
            raise ValueError(
                f"Documents.valid gives {tuple(valid.shape)} flags for this MoE's tokens "
                f"{tuple(want)} (after cp={self.cp} / tp layout {self.tp_layout!r} split): the "
                "mask must cover whole rows [B, S] of this micro-batch; under context "
                "parallelism the layer needs its cp_group (mesh=)"
            )
        return valid.reshape(-1)

    def _forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        batch_first = x.dim() == 3 and self.sequence_dim % 3 == 1
        if self.tp_layout == "sequence" and self.router.aux_loss == "sequence" and not batch_first:
            raise ValueError(
                "aux_loss='sequence' with sequence parallelism needs batch-first input [B, S/tp, "
                f"H] split along dim 1, got {tuple(x.shape)} along dim {self.sequence_dim}"
            )
        tokens = x.reshape(-1, self.hidden_size)
        routing = self.router(tokens, seq_len=shape[-2] if x.dim() >= 3 else None, valid=valid)
        permuted, info = moe_permute(
            tokens, routing.expert_ids, self.num_experts, routing.capacity, routing.order
        )
        weights = self.router.combine_weights(routing, info.slots)
        balance, z = self.router.aux_losses(routing, info.counts)
        self.aux_loss = balance + z
        self.stats = {"counts": info.counts, "num_dropped": info.num_dropped}
        if info.capacity is not None:
            if self.ep > 1:
                self._check_same_capacity(tokens.shape[0], info.capacity, tokens.device)
            out = self._capacity_path(permuted, info.capacity)
        else:
            out = self._dropless_path(permuted, info.counts)
        y = moe_unpermute(out.to(permuted.dtype), upcast(weights), info)
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            y = y + shared.to(y.dtype)
        scale = self._aux_scale()
        if scale is not None and self.training and torch.is_grad_enabled():
            y = InjectAuxGrad.apply(y, self.aux_loss, scale)
            self.aux_loss = self.aux_loss.detach()  # in backward already: a value to log
        return y.view(shape)

    def _aux_scale(self) -> float | torch.Tensor | None:
        """The weight this forward's aux loss enters backward with (docs/moe.md, "The aux loss
        in backward"); × cp under context parallelism, whose dp × cp gradient average would
        divide it by cp."""
        scale = self.aux_loss_scale
        if scale is None:
            scale = block_scale(1.0 if self.aux_loss_in_backward else None)
        return scale if scale is None or self.cp == 1 else scale * self.cp

    def _capacity_path(self, permuted: torch.Tensor, capacity: int) -> torch.Tensor:
        """[E, C, H] -> expert outputs [E, C, H]; with EP, equal-split all-to-alls."""
        e_loc, h = self.num_local, self.hidden_size
        if self.ep == 1:
            return self._experts_batched(permuted)
        if self.overlap_chunks > 1:
            chunks = CapacityChunks(self.num_experts, capacity, h, self.ep, self.overlap_chunks)
            return OverlappedExperts.apply(
                permuted,
                chunks,
                lambda x, j: self._experts_batched(x),
                self.ep_group,
                *self._expert_params(),
            )
        # rows for rank j's experts go to rank j: [ep·E_local·C, H] in, the same shape back
        recv = all_to_all(permuted.reshape(-1, h), self.ep_group)
        recv = (
            recv.view(self.ep, e_loc, capacity, h)
            .transpose(0, 1)
            .reshape(e_loc, self.ep * capacity, h)
        )
        out = self._experts_batched(recv)
        out = out.view(e_loc, self.ep, capacity, h).transpose(0, 1).reshape(-1, h)
        return all_to_all(out, self.ep_group).view(self.num_experts, capacity, h)

    def _check_same_capacity(self, tokens: int, capacity: int, device: torch.device) -> None:
        """Capacity mode's all-to-alls have fixed splits: every EP rank must hold the same
        capacity (the same token count, in practice), or the transfers would not match (a crash
        in gloo, a hang or garbage in NCCL). Checked with a two-number all-gather before the
        first all-to-all: on every forward over a CPU (gloo) group, where it costs no device
        sync, and on the first forward over NCCL, so the hot path stays free of host syncs.
        Every rank sees the same numbers, so every rank raises the same error (no hang)."""
        every_call = dist.get_backend(self.ep_group) == "gloo"
        if self._capacity_checked and not every_call:
            return
        mine = torch.tensor([tokens, capacity], dtype=torch.int64, device=device)
        got = [torch.empty_like(mine) for _ in range(self.ep)]
        plain.all_gather(got, mine, group=self.ep_group)
        all_tokens = [int(g[0]) for g in got]
        capacities = [int(g[1]) for g in got]
        if len(set(capacities)) > 1:
            raise ValueError(
                "MoE capacity mode with expert parallelism needs the same capacity on every rank "
                f"of the expert-parallel group (fixed all-to-all splits); the EP ranks routed "
                f"{all_tokens} tokens, giving capacities {capacities}. Give every rank the same "
                "batch shape, or use dropless routing (capacity_factor=None), which handles uneven "
                "token counts"
            )
        self._capacity_checked = True

    def _dropless_path(self, permuted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[T·k, H] expert-major -> expert outputs in the same layout. EP = 1: grouped matmuls
        over the device ``counts``, no host sync. EP > 1: ``ep_dispatch`` / ``ep_combine``
        (custom ops; the split sizes are read on the host once, inside the dispatch op, so a
        compiled graph does not break there)."""
        if self.ep == 1:
            return self._experts_segments(permuted, counts)
        if self.overlap_chunks > 1:
            return self._dropless_overlapped(permuted, counts)
        rows, recv_counts, route = ep_dispatch(permuted, counts, self.ep_group)
        return ep_combine(self._experts_segments(rows, recv_counts.sum(0)), route)

    def _dropless_overlapped(self, permuted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The chunked (overlapped) dropless path: its chunk index lists are built on the host
        from the exchanged counts, so ``torch.compile`` runs it eagerly (one graph break)."""
        send = counts.view(self.ep, self.num_local)
        recv_counts = all_to_all(send.contiguous(), self.ep_group)  # [ep (source), E_local]
        chunks = DroplessChunks(
            counts.tolist(),
            recv_counts.tolist(),
            self.hidden_size,
            self.ep,
            self.overlap_chunks,
            permuted.device,
        )
        return OverlappedExperts.apply(
            permuted,
            chunks,
            lambda x, j: self._experts_segments(x, chunks.seg[j]),
            self.ep_group,
            *self._expert_params(),
        )

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, expert={self.expert}, "
            f"experts={self.num_experts} "
            f"({self.num_local} local, ep={self.ep}), top_k={self.top_k}, "
            f"capacity_factor={self.router.capacity_factor}, policy={self.router.drop_policy}"
            + ("" if self.expert != "glu" else f", activation={self.activation}")
        )


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the auxiliary losses of every MoE layer of ``model`` from its last forward:
    differentiable for the layers that left it to the caller (``aux_loss_in_backward=False``,
    eval mode), a detached value for those that sent it to backward themselves."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack([upcast(loss) for loss in losses]).sum()
