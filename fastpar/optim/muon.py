"""``Muon``: momentum orthogonalised by Newton–Schulz on each whole logical matrix, AdamW
(``FusedAdamW``) on everything else, under every fastpar layout (docs/muon.md).

    opt = Muon(muon_param_groups(model, weight_decay=0.1), lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

A param group with ``"muon": True`` holds matrices: whole tensors, tensor-parallel shards
(``fastpar.mesh.placement`` marks: all-gathered over their TP group, fused blocks split), expert
stacks (each expert its own matrix) or the data-parallel family's flat shards (each whole
parameter by one owner rank); ``"muon": False`` groups step with AdamW."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from fastpar.mesh.placement import is_expert
from fastpar.optim.fused_adamw import FusedAdamW
from fastpar.optim.muon_matrices import FLAT_ATTR, flat_update, owners, pieces, whole_update
from fastpar.reference.muon import ADJUST_LR, NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalize

ADAMW_MODULES = ("Embedding", "VocabParallelEmbedding", "TopKRouter", "Head", "MTPHead")
"""Class names whose own parameters go to AdamW by default: embeddings, routers, LM heads."""
ADAMW_NAMES = ("embed", "lm_head", "wte", "wpe", "router", "mlp.gate.")
"""Parameter-name fragments that go to AdamW by default (Hugging Face's embeddings, heads and
MoE routers: ``model.embed_tokens``, ``lm_head``, ``mlp.gate``)."""

IsMatrix = Callable[[str, nn.Parameter, nn.Module], bool]


def matrix_dims(p: torch.Tensor) -> int:
    """The dims of each of ``p``'s matrices: an expert stack's dim 0 counts experts (its
    [E, F] bias is E vectors, its [E, A, B] weight E matrices)."""
    return p.dim() - (1 if is_expert(p) else 0)


def is_hidden_matrix(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """The default rule: a matrix (``matrix_dims`` 2: [A, B], experts [E, A, B]) that is no
    embedding, LM head or router (``ADAMW_MODULES``, ``ADAMW_NAMES``)."""
    if matrix_dims(param) != 2 or type(module).__name__ in ADAMW_MODULES:
        return False
    return not any(frag in name for frag in ADAMW_NAMES)


def muon_param_groups(
    module: nn.Module, weight_decay: float = 0.1, *, is_matrix: IsMatrix | None = None
) -> list[dict]:
    """Muon's groups for ``module``: the hidden matrices (``is_matrix``, default
    ``is_hidden_matrix``; name, parameter, owning module) with ``"muon": True`` and
    ``weight_decay``; AdamW's other matrices with ``weight_decay``, its vectors without; empty
    groups left out; every parameter once."""
    rule = is_matrix or is_hidden_matrix
    buckets: dict[str, list] = {"muon": [], "decay": [], "no_decay": []}
    seen: set[int] = set()
    for mname, mod in module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mname}.{pname}" if mname else pname
            kind = "muon" if rule(name, p, mod) else "decay" if p.dim() >= 2 else "no_decay"
            buckets[kind].append(p)
    groups = [
        {"params": buckets["muon"], "muon": True, "weight_decay": weight_decay},
        {"params": buckets["decay"], "muon": False, "weight_decay": weight_decay},
        {"params": buckets["no_decay"], "muon": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class Muon(torch.optim.Optimizer):
    """Muon on the ``"muon": True`` groups, AdamW on the others; the update, ``per_head`` and
    ``comm_bytes``: docs/muon.md. State: ``momentum_buffer`` (Muon), ``step`` / ``exp_avg`` /
    ``exp_avg_sq`` (AdamW: ``betas``, ``eps``). A nonzero ``found_inf`` attribute (torch's amp
    protocol) skips the step on the device."""

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = NS_STEPS,
        ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
        ns_eps: float = NS_EPS,
        adjust_lr: str = "match_rms_adamw",
        ns_dtype: torch.dtype | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        per_head: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"invalid momentum {momentum}: must lie in [0, 1)")
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr {adjust_lr!r} must be one of {', '.join(ADJUST_LR)}")
        if not (isinstance(ns_steps, int) and ns_steps >= 1):
            raise ValueError(f"ns_steps must be a positive integer, got {ns_steps!r}")
        ns = dict(ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps)
        adam = dict(betas=betas, eps=eps, maximize=False)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        defaults.update(ns, adjust_lr=adjust_lr, ns_dtype=ns_dtype, muon=None, **adam)
        defaults["per_head"] = bool(per_head)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["muon"] is None:
                group["muon"] = all(matrix_dims(p) == 2 for p in group["params"])
        self._adamw = FusedAdamW([torch.zeros(1, requires_grad=True)])
        self.comm_bytes = {"tp_gather": 0.0, "dp_gather": 0.0, "dp_scatter": 0.0}
        self._owners: dict[int, list] = {}  # id(flat master) -> [((index, expert), rank, cost)]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        inv = None if scale is None else torch.reciprocal(scale.float())
        adam = [g for g in self.param_groups if not g["muon"]]
        if adam:  # a real FusedAdamW over our groups and state (its kernels, its checks)
            self._adamw.param_groups, self._adamw.state = adam, self.state
            self._adamw.amp_step(found_inf=found, inv_scale=inv)
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group, found, inv)
        return loss

    def _muon_group(self, group: dict, found, inv) -> None:
        ortho = partial(
            orthogonalize,
            steps=group["ns_steps"],
            coefficients=group["ns_coefficients"],
            eps=group["ns_eps"],
            adjust_lr=group["adjust_lr"],
            dtype=group["ns_dtype"],
        )
        skip = skip_on_host(found)
        if skip:
            return  # every rank agreed on found_inf: all skip alike, no collective runs
        keep = None if skip is not None else found.reshape(()) != 0  # decided on the device
        lr, mom, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
            if inv is not None:
                g = g * inv.to(g.device)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            new_buf = buf.lerp(g, 1 - mom)
            update = g.lerp(new_buf, mom) if group["nesterov"] else new_buf
            o = self._orthogonalized(p, update, ortho, group.get("per_head", False))
            new_p = p.mul(1 - lr * wd).add_(o, alpha=-lr)
            if keep is not None:
                new_buf, new_p = torch.where(keep, buf, new_buf), torch.where(keep, p, new_p)
            buf.copy_(new_buf)
            p.copy_(new_p)

    def _orthogonalized(self, p: torch.Tensor, update: torch.Tensor, ortho, per_head: bool):
        flat = getattr(p, FLAT_ATTR, None)
        if flat is None:
            _check_matrix(p)
            return whole_update(update, p, ortho, self.comm_bytes, per_head)
        if id(p) not in self._owners:
            self._assign_owners()
        owner = [(piece, rank) for piece, rank, _ in self._owners[id(p)]]
        return flat_update(update, flat, ortho, self.comm_bytes, owner, per_head)

    def _assign_owners(self) -> None:
        """One owner rank per piece (a whole parameter, or one expert of a stack) of every flat
        Muon master, balanced over all the flats that shard over the same group (ZeRO-3 has one
        flat per unit)."""
        by_group: dict[int, list] = {}
        for group in self.param_groups:
            for p in group["params"] if group["muon"] else ():
                flat = getattr(p, FLAT_ATTR, None)
                if flat is not None:
                    by_group.setdefault(id(flat.group), []).append(p)
        for masters in by_group.values():
            items = []
            for m in masters:
                flat = m._fastpar_flat
                for q, shape in zip(flat.params, flat.shapes, strict=True):
                    _check_matrix(q, shape)  # (ZeRO-3: q is empty between steps)
                items += [(m, piece, cost) for piece, cost in pieces(flat)]
                self._owners[id(m)] = []
            assigned = owners([cost for _, _, cost in items], masters[0]._fastpar_flat.size)
            for (m, piece, cost), rank in zip(items, assigned, strict=True):
                self._owners[id(m)].append((piece, rank, cost))

    def owner_load(self) -> list[list[float]]:
        """Per group the flats shard over (dense, expert): the Newton–Schulz cost (flops ∝
        A·B·min(A, B)) each of its ranks owns — the owners' load balance."""
        loads: dict[int, list[float]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                flat = getattr(p, FLAT_ATTR, None)
                if flat is None or id(p) not in self._owners:
                    continue
                load = loads.setdefault(id(flat.group), [0.0] * flat.size)
                for _, rank, cost in self._owners[id(p)]:
                    load[rank] += cost
        return list(loads.values())


def skip_on_host(found: torch.Tensor | None) -> bool | None:
    """Whether to skip, when the flag can be read for free (None: no flag, or a CPU one);
    None when it lives on a device (then the step is computed and discarded there)."""
    if found is None:
        return False
    return bool(found.reshape(()) != 0) if found.device.type == "cpu" else None


def _check_matrix(p: torch.Tensor, shape: torch.Size | None = None) -> None:
    shape = p.shape if shape is None else shape
    if len(shape) - is_expert(p) != 2:
        what = "an expert stack" if is_expert(p) else "a parameter"
        raise ValueError(
            f"Muon: {what} of shape {tuple(shape)} in a 'muon' group: Muon orthogonalises "
            "matrices ([A, B], experts [E, A, B]); put vectors and biases in a group with "
            "'muon': False (fastpar.optim.muon_param_groups)"
        )
