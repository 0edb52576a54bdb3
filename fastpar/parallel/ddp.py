"""``DistributedDataParallel``: bucketed gradient all-reduce over the data-parallel group,
overlapped with backward.

    model = DistributedDataParallel(model, mesh=mesh)      # dp group from the mesh
    loss = model(x).loss; loss.backward()                  # buckets all-reduce as backward runs
    optimizer.step(); model.zero_grad()

Each parameter's ``.grad`` is a view into its bucket's flat buffer, so autograd accumulates
straight into the buffer; when a bucket's last gradient arrives its all-reduce starts
asynchronously (gradients divided by the DP size first, then summed: gloo has no AVG), and
backward's end waits for all of them, so ``.grad`` holds the DP average when ``backward()``
returns. ``no_sync()`` accumulates without communicating (gradient accumulation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from fastpar.mesh.placement import data_parallel_groups, duplicated_over, is_expert
from fastpar.mesh.ranks import global_rank, group_size
from fastpar.parallel.buckets import Bucket, BucketReducer, build_buckets, payload_bytes


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` for data parallelism over ``mesh.dp_group`` (or ``group``; None = the
    default group).

    ``bucket_size_mb``: bucket capacity. ``reduce_dtype``: reduce low-precision gradients in
    this dtype (e.g. torch.float32 for bf16 gradients). ``find_unused_parameters``: treat
    parameters that got no gradient in a backward as zero-gradient instead of raising.
    Parameters and buffers are broadcast from the group's first rank when wrapped.
    ``comm_bytes`` counts the bytes this rank sent (ring all-reduce: 2(N-1)/N of each bucket).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        mesh=None,
        group: dist.ProcessGroup | None = None,
        bucket_size_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        find_unused_parameters: bool = False,
        broadcast_parameters: bool = True,
    ) -> None:
        super().__init__()
        if mesh is not None and group is not None:
            raise ValueError("pass either mesh= or group=, not both")
        self.module = module
        # expert parameters (fastpar.nn.MoE) differ across the EP group: they are replicated,
        # and reduced, over the expert-data-parallel group only
        self._groups = list(data_parallel_groups(mesh, group))
        self.group = self._groups[0]
        self._sizes = [group_size(g) for g in self._groups]
        self.dp_size = self._sizes[0]
        self.reduce_dtype = reduce_dtype
        self.comm_bytes = 0.0
        self._pending_tied: list = []
        dense = [p for p in module.parameters() if not is_expert(p)]
        experts = [p for p in module.parameters() if is_expert(p)]
        if broadcast_parameters:
            with torch.no_grad():
                for tensors, g, n in ((dense + list(module.buffers()), self._groups[0], self._sizes[0]),
                                      (experts, self._groups[1], self._sizes[1])):  # fmt: skip
                    if n > 1:
                        for t in tensors:
                            dist.broadcast(t.data, src=global_rank(g, 0), group=g)
        groups = [[p for p in dense if p.requires_grad], [p for p in experts if p.requires_grad]]
        self.buckets = build_buckets(groups, bucket_size_mb, pad_to=1)
        self._buffers_flat: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            buf = torch.zeros(b.padded_numel, dtype=b.dtype, device=b.params[0].device)
            self._buffers_flat[b.index] = buf
            for i, p in enumerate(b.params):
                p.grad = b.view(buf, i)
        names = {id(p): n for n, p in module.named_parameters()}
        self.reducer = BucketReducer(
            self.buckets,
            launch=self._launch,
            finish=self._finish,
            grad_target=self._grad_target,
            find_unused_parameters=find_unused_parameters,
            names=names,
        )

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        with self.reducer.no_sync():
            yield

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient buffers (``.grad`` stays a view into them)."""
        for b in self.buckets:
            buf = self._buffers_flat[b.index]
            buf.zero_()
            for i, p in enumerate(b.params):
                p.grad = b.view(buf, i)

    # -- reducer callbacks ------------------------------------------------------------------
    def _grad_target(self, b: Bucket, i: int, p: nn.Parameter | None) -> None:
        view = b.view(self._buffers_flat[b.index], i)
        if p is None:  # unused this backward: contributes zero (keeps what no_sync accumulated)
            param = b.params[i]
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                view.zero_()  # the buffer holds a previous step's gradient
            param.grad = view
            return
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            # the user set .grad to None (zero_grad(set_to_none=True)): a fresh tensor arrived
            view.copy_(p.grad)
        p.grad = view

    def _launch(self, b: Bucket):
        group, size = self._groups[b.group_index], self._sizes[b.group_index]
        buf = self._buffers_flat[b.index]
        if size == 1:  # e.g. experts when EP = DP: nothing to reduce, still the DP average
            if self.dp_size > 1:
                buf.div_(self.dp_size)
            return None
        if self.reduce_dtype is not None and self.reduce_dtype != buf.dtype:
            comm = b.comm = buf.to(self.reduce_dtype)
        else:
            comm = buf
        # the loss is averaged over the dense DP group; an expert's local gradient already sums
        # the tokens of its EP group, so experts are also divided by the dense DP size
        comm.div_(self.dp_size)
        self.comm_bytes += payload_bytes("all_reduce", comm.numel(), comm.element_size(), size)
        return dist.all_reduce(comm, group=group, async_op=True)

    def _finish(self, b: Bucket) -> None:
        if b.comm is not None:
            self._buffers_flat[b.index].copy_(b.comm)
            b.comm = None
        # a parameter held on several pipeline stages (tied embedding, marked duplicated): its
        # holders' gradients are summed in finish_grad_sync(), after the pipeline step (here,
        # inside a stage's backward, the other stage may still be waiting for our gradients)
        for i, p in enumerate(b.params):
            for g in duplicated_over(p):
                self._pending_tied.append((b.view(self._buffers_flat[b.index], i), g))

    def finish_grad_sync(self) -> None:
        """Wait for every in-flight bucket (backward's end does this by itself) and sum the
        gradients of parameters shared between pipeline stages (the pipeline engine calls this
        after its last backward)."""
        self.reducer.wait_all()
        pending, self._pending_tied = self._pending_tied, []
        for view, group in pending:
            dist.all_reduce(view, group=group)
