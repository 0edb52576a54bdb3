"""``parallelize``: make a plain PyTorch or Hugging Face transformer tensor-parallel, in place.

    model = fastpar.parallelize(model, mesh=mesh)                 # a built-in plan
    model = fastpar.parallelize(model, {"*.mlp.c_fc": "column", "*.mlp.c_proj": "row"}, mesh)

The styles and the checks made before the model is used (static checks, the data-flow probe,
the output comparison): docs/hf.md ("parallelize: built-in plans or your own")."""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fastpar import tolerance
from fastpar.comm import all_reduce_grad, group_size
from fastpar.mesh.bridge import as_group
from fastpar.mesh.groups import ParallelMesh
from fastpar.mesh.placement import mark_owned, mark_replicated
from fastpar.nn import blocks as _blocks
from fastpar.nn import check as _check
from fastpar.nn import plans as _plans
from fastpar.nn.diagnose import failed_message, refuse, tracking
from fastpar.nn.guard import guard_save_pretrained
from fastpar.nn.head_lists import slice_head_lists
from fastpar.nn.linear import is_conv1d
from fastpar.nn.plan import (
    HEAD_ATTRS,
    WIDTH_ATTRS,
    head_counts,
    match,
    splits_output,
    static_checks,
)
from fastpar.nn.probe import FULL, SPLIT, ProbeFailed, ProbeReport, probe
from fastpar.nn.styles import STYLES, linear_like


@dataclass
class PlanRecord:
    """What ``parallelize`` did: the style of every planned module, the parameters whose
    gradient is all-reduced over TP (declared "per_head" or found by the probe), whether the
    probe and the output check ran, and the output check's relative difference."""

    tp_size: int
    styles: dict[str, str]
    grad_reduced: list[str] = field(default_factory=list)
    found_by_probe: list[str] = field(default_factory=list)
    probed: bool = False
    output_rel_diff: float | None = None
    checked: str | None = None
    """Which check ran: "backward" (output and every gradient), "forward" or None."""
    head_sliced: list[str] = field(default_factory=list)
    """Parameters of per-head module lists this rank keeps (its heads' share)."""
    shared_key: list[str] = field(default_factory=list)
    """Linear layers made "shared_key" because the probe found their output read by every
    local head (MLA's rope key left "replicate" or unplanned)."""
    unchecked: list[str] = field(default_factory=list)
    """Parameters the backward check could not map to a dense gradient (none for the built-in
    plans: converted MoE experts are compared against their EP and TP slice)."""


def _example_inputs(model: nn.Module, example_inputs) -> tuple[tuple, dict] | None:
    """(args, kwargs) for the probe: the caller's, or token ids for a language model."""
    if example_inputs is not None:
        if isinstance(example_inputs, Mapping):
            return (), dict(example_inputs)
        if isinstance(example_inputs, torch.Tensor):
            return (example_inputs,), {}
        return tuple(example_inputs), {}
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(0)  # never the global stream: layouts must draw alike
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        limit = [
            v
            for k in ("max_position_embeddings", "n_positions")
            if isinstance(v := getattr(config, k, None), int)
        ]
        ids = torch.randint(0, vocab, (2, min([8, *limit])), generator=g).to(device)
        kwargs = {"input_ids": ids}
        if "use_cache" in inspect.signature(model.forward).parameters:
            kwargs["use_cache"] = False
        return (), kwargs
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return (torch.randint(0, m.num_embeddings, (2, 8), generator=g).to(device),), {}
        if linear_like(m):
            w = m.weight
            width = w.shape[0] if is_conv1d(m) else w.shape[1]
            return (torch.randn(2, width, generator=g).to(device=device, dtype=w.dtype),), {}
    return None


def _owners(modules: Mapping[str, nn.Module]) -> dict[int, list[tuple[str, str]]]:
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in modules.items():
        for p_name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, p_name))
    return owners


def _style_at(chosen, owner: str):
    """The style record the plan gives module ``owner``; None where it is not planned."""
    entry = chosen.get(owner)
    return None if entry is None else STYLES[entry[0]]


def _keeps_replicated(style) -> bool:
    return style is not None and style.declares and not style.reduces_grad


def _declares_reduced(style) -> bool:
    return style is not None and style.declares and style.reduces_grad


def _analyse(report: ProbeReport, chosen, modules, watched_owner) -> list[str]:
    """Refuse what cannot be exact; return the parameters to all-reduce over TP."""
    for where, source in report.mixed:
        raise ValueError(
            f"the plan splits {source!r} but its split output is contracted ({where}) with an "
            f"activation that is not split: split every projection that feeds this op together "
            f"(q_proj, k_proj and v_proj), or none of them"
        )
    for name, where in report.contracted.items():
        raise ValueError(
            f"parameter {name!r} is contracted with a split activation ({where}) but its module "
            f"is not planned: plan {watched_owner[name]!r} as 'row' (it consumes a column split), "
            f"or gather the column output (gather_output=True)"
        )
    for name, (where, source) in report.features.items():
        raise ValueError(
            f"parameter {name!r} acts elementwise on the split features of {source!r} ({where}): "
            f"after the split each rank holds only its share of those features, so the whole "
            f"parameter no longer fits; make it {source!r}'s own bias, or gather that output "
            f"(gather_output=True)"
        )
    reduced = []
    for name, uses in report.uses.items():
        owner = watched_owner[name]
        declared = _style_at(chosen, owner)
        if uses == {SPLIT, FULL}:
            raise ValueError(
                f"parameter {name!r} is used both on split activations (this rank's heads) and "
                f"on whole ones: neither replicating nor reducing its gradient is exact; split "
                f"its module differently or keep the whole block dense"
            )
        if SPLIT in uses:
            if _keeps_replicated(declared):
                raise ValueError(
                    f"plan marks {owner!r} {declared.name!r} but its parameter {name!r} sees "
                    f"split activations (this rank's heads only): plan it as 'per_head'"
                )
            reduced.append(name)
    for owner, (style, _) in chosen.items():
        if _declares_reduced(STYLES[style]):
            names = [n for n, o in watched_owner.items() if o == owner]
            if not any(SPLIT in report.uses.get(n, ()) for n in names):
                raise ValueError(
                    f"plan marks {owner!r} {style!r} but it never sees a split activation: "
                    f"reducing its gradient over TP would multiply it by the TP size; drop the entry"
                )
    return reduced


def _shared_keys(report: ProbeReport, chosen, modules, record) -> None:
    """A linear layer no plan swaps whose last output features enter the split heads outside a
    contraction (MLA's rope key) becomes "shared_key" over those features (their gradient
    all-reduced over TP); the check then judges the result."""
    for name, (lo, hi, width, _) in report.shared.items():
        entry = chosen.get(name)
        whole = entry is None or entry[0] == "replicate"
        if whole and type(modules.get(name)) is nn.Linear and hi == width and lo < hi:
            chosen[name] = ("shared_key", {"features": hi - lo})
            record.shared_key.append(name)


def _unprobed(chosen, modules, attention, watched_owner) -> list[str]:
    """Without a probe: parameters inside an attention module that splits its heads must be
    declared; returns the declared per_head ones."""
    reduced = []
    for name, owner in watched_owner.items():
        style = _style_at(chosen, owner)
        if _declares_reduced(style):
            reduced.append(name)
            continue
        inside = [a for a in attention if not a or owner == a or owner.startswith(a + ".")]
        if inside and not _keeps_replicated(style):
            raise ValueError(
                f"parameter {name!r} sits inside {inside[0]!r}, whose heads are split over TP, "
                f"and may see only this rank's heads (a per-head norm gets a partial gradient). "
                f"Plan {owner!r} as 'per_head' if it acts on the split heads or 'replicate' if it "
                f"sees whole activations, or pass example_inputs= so the probe can tell"
            )
    return reduced


def _check_router_logits(model: nn.Module) -> None:
    """HF adds its router aux loss from router logits its forward records off its own router
    classes; converted blocks record none, so that loss would silently vanish: refused."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "parallelize: config.output_router_logits=True makes Hugging Face add its router "
            "aux loss from logits recorded off its router modules, which the converted MoE blocks "
            "do not have (the loss would silently lose that term); set "
            "config.output_router_logits=False and train with fastpar's aux loss "
            "(moe_from_hf options aux_loss=..., aux_loss_coef=...), or plan the experts "
            "'replicate'"
        )


def _swap(model, modules, chosen, tp_group, ep_group=None) -> dict[str, nn.Module]:
    new_modules = {}
    for n, (style, kwargs) in chosen.items():
        swap = STYLES[style].swap
        if swap is None:
            continue
        new = swap(modules[n], tp_group, ep_group, **kwargs)
        parent_name, _, attr = n.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, attr, new)
        new_modules[n] = new
    return new_modules


def _retie(owners, modules, new_modules, model) -> None:
    """Parameters that were one tensor before are one again: the sharded version wins (an
    unplanned layer holding a tied copy of a split parameter is refused)."""

    def module(name: str) -> nn.Module:
        if name in new_modules:
            return new_modules[name]
        return modules[name] if name else model

    for shared in owners.values():
        if len(shared) < 2:
            continue
        swapped = [(m, p) for m, p in shared if m in new_modules]
        if not swapped:
            continue
        first_m, first_p = swapped[0]
        first = getattr(module(first_m), first_p)
        for m, p in shared:
            t = getattr(module(m), p)
            if t is first:
                continue
            if m in new_modules:
                if t.shape != first.shape:
                    raise ValueError(
                        f"{m}.{p} was tied to {first_m}.{first_p} but their sharded shapes differ "
                        f"({tuple(t.shape)} vs {tuple(first.shape)}); shard both the same way "
                        f"(pad_output=True on a column-split LM head matches a vocab embedding)"
                    )
            elif isinstance(module(m), (nn.Linear, nn.Embedding)) or is_conv1d(module(m)):
                raise ValueError(
                    f"{m}.{p} is tied to {first_m}.{first_p}, which the plan splits, but {m!r} "
                    f"is not planned: plan it the same way (a tied LM head as 'column' with "
                    f"pad_output=True)"
                )
            setattr(module(m), p, first)


def _divide_heads(model, modules, parents, heads, world) -> None:
    for n in parents:
        module = modules[n] if n else model
        extra = [
            a for pat, attrs in (heads or {}).items() if fnmatch.fnmatchcase(n, pat) for a in attrs
        ]
        for attr in dict.fromkeys((*HEAD_ATTRS, *WIDTH_ATTRS, *extra)):
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                if attr in extra:
                    raise ValueError(f"heads: module {n!r} has no integer attribute {attr!r}")
                continue
            if value % world:
                raise ValueError(
                    f"module {n!r} has {attr}={value}, not divisible by the tensor-parallel size "
                    f"{world}: attention heads cannot be split evenly; use a TP size that divides {value}"
                )
            setattr(module, attr, value // world)


def _split(
    model,
    modules,
    chosen,
    owners,
    attention,
    watched,
    watched_owner,
    inputs,
    mode,
    record,
    tp_group,
    ep_group,
    heads,
    world,
    blocks,
):
    """Probe, run the dense references (``blocks``: each distinct block once, emptied when
    the model cannot run so), swap, divide heads, slice per-head lists, retie and
    hook the reduced gradients; returns (reduced, the dense references or None, sliced)."""
    ref = None
    if inputs is not None:
        styles = {
            n: SPLIT if splits_output(s, kw) else FULL
            for n, (s, kw) in chosen.items()
            if STYLES[s].layer
        }
        backward = mode == "backward"
        reports = []

        def probed(m, args):  # the check's float64 run is the probe's (docs/hf.md, "The check")
            report, out = probe(m, *args, styles, watched, grad=torch.is_grad_enabled())
            reports.append(report)
            return out

        try:  # each distinct block once (a model that cannot run so: all of them)
            try:
                with _blocks.only(model, blocks):
                    ref = _check.dense_runs(model, inputs, backward, probed, set(watched))
            except ProbeFailed:
                if not blocks:
                    raise
                blocks.clear()
                ref = _check.dense_runs(model, inputs, backward, probed, set(watched))
        except ProbeFailed as exc:
            raise ValueError(
                f"parallelize: the dense {type(model).__name__} failed on the probe input "
                f"({exc}); pass example_inputs= that its forward accepts, "
                "or check=False"
            ) from exc
        report = reports[-1]
        # what the probe saw of a block's parameters and modules holds for its copies
        uses = _blocks.to_copies(report.uses, blocks)
        report.uses = {n: report.uses[first] for n, first in uses.items()}
        shared = _blocks.to_copies(report.shared, blocks)
        report.shared = {n: report.shared[first] for n, first in shared.items()}
        reduced = _analyse(report, chosen, modules, watched_owner)
        _shared_keys(report, chosen, modules, record)
        record.probed = True
        record.found_by_probe = [
            n for n in reduced if not _declares_reduced(_style_at(chosen, watched_owner[n]))
        ]
    else:
        reduced = _unprobed(chosen, modules, attention, watched_owner)
    parents = sorted(
        {n.rpartition(".")[0] for n, (s, kw) in chosen.items() if splits_output(s, kw)}
    )
    counts = {n: set(head_counts(modules[n] if n else model, model).values()) for n in parents}
    new_modules = _swap(model, modules, chosen, tp_group, ep_group)
    _divide_heads(model, modules, parents, heads, world)
    sliced = slice_head_lists(
        model, modules, [a for a in parents if a in attention], counts, tp_group, world
    )
    _retie(owners, modules, new_modules, model)
    params = dict(model.named_parameters(remove_duplicate=False))
    # a sliced per-head module is this rank's alone (the others' are gone): never reduced
    reduced = [n for n in reduced if n in params and n not in set(sliced)]
    record.grad_reduced, record.head_sliced = sorted(reduced), sorted(sliced)
    for name in sliced:  # its heads' entries: counted, saved and exported from this rank
        mark_owned(params[name], tp_group)
    for name in reduced:
        p = params[name]
        mark_replicated(p, tp_group)
        if p.requires_grad and world > 1:
            all_reduce_grad(p, tp_group)
    return reduced, ref, sliced


def parallelize(
    model: nn.Module,
    plan: Mapping[str, object] | None = None,
    mesh: ParallelMesh | DeviceMesh | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    heads: Mapping[str, list[str]] | None = None,
    example_inputs=None,
    check: bool | str = True,
    loss_parallel: bool = False,
) -> nn.Module:
    """Swap the modules named by ``plan`` (default: the built-in plan of the model's family)
    for their fastpar twins, in place; returns ``model``. Every TP rank must call it with
    identical weights (same seed or checkpoint) and identical ``example_inputs``. The arguments
    (``heads``, ``example_inputs``, ``check``, ``loss_parallel``): docs/hf.md ("parallelize:
    built-in plans or your own")."""
    tp_group = as_group(mesh, "tp", group)  # the groups, once: a DeviceMesh has no ep group
    ep_group = mesh.ep_group if getattr(mesh, "ep_size", 1) > 1 else None
    world = group_size(tp_group)
    strict = plan is not None
    if plan is None:
        plan = _plans.builtin_plan(model, loss_parallel=loss_parallel)
        if plan is None:
            raise ValueError(
                f"no built-in plan for {type(model).__name__} (model_type "
                f"{_plans.model_type(model)!r}); built-in families: {_plans.supported()}. Pass a "
                f"plan: {{'*.q_proj': 'column', ..., '*.o_proj': 'row'}}"
            )
    modules = dict(model.named_modules())
    chosen = match(model, plan, strict)
    if not strict:  # a built-in "experts" pattern also matches the dense MLPs between MoEs
        chosen = {
            n: c
            for n, c in chosen.items()
            if not STYLES[c[0]].skip_unfit or STYLES[c[0]].fits(n, modules[n])
        }
    if any(STYLES[style].replaces_router for style, _ in chosen.values()):
        _check_router_logits(model)
    attention = static_checks(model, modules, chosen, world, heads)

    owners = _owners(modules)
    layer_params = {
        id(p) for n, (s, _) in chosen.items() if STYLES[s].layer for p in modules[n].parameters()
    }
    watched, watched_owner = {}, {}
    for mod_name, mod in modules.items():
        for p_name, p in mod.named_parameters(recurse=False):
            if id(p) not in layer_params and id(p) not in watched:
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                watched[id(p)], watched_owner[full] = full, mod_name
    declared_owner = {}  # a parameter belongs to the innermost per_head / replicate entry
    for name, owner in watched_owner.items():
        for n in chosen:
            inside = owner == n or owner.startswith(n + ".")
            deeper = len(n) > len(declared_owner.get(name, ""))
            if STYLES[chosen[n][0]].declares and inside and deeper:
                declared_owner[name] = n
    watched_owner = {name: declared_owner.get(name, owner) for name, owner in watched_owner.items()}

    mode = _check.check_mode(check)
    inputs = _example_inputs(model, example_inputs) if mode else None
    record = PlanRecord(world, {n: s for n, (s, _) in chosen.items()})
    # perturbed for the check and restored after it: the parameters that stay in place (a
    # swapped module's, an MoE block's router included, are copied into the new module)
    swapped = {
        id(p) for n, (s, _) in chosen.items() if STYLES[s].swap for p in modules[n].parameters()
    }
    watched_params = {
        n: p for n, p in model.named_parameters() if n in watched_owner and id(p) not in swapped
    }
    saved = _check.perturb(watched_params) if inputs is not None and mode == "backward" else {}
    # the check runs each distinct block of a repeated stack once (docs/hf.md, "The check")
    blocks = _blocks.distinct_blocks(model, chosen) if inputs is not None else {}
    try:
        reduced, ref, sliced = _split(
            model,
            modules,
            chosen,
            owners,
            attention,
            watched,
            watched_owner,
            inputs,
            mode,
            record,
            tp_group,
            ep_group,
            heads,
            world,
            blocks,
        )
        if ref is not None:
            with _blocks.only(model, blocks), tracking(model) as where:
                try:
                    verdict = _check.parallel_run(model, inputs, ref, tp_group, world, set(sliced))
                except Exception as exc:
                    split = [n for n, (s, kw) in chosen.items() if splits_output(s, kw)]
                    raise ValueError(failed_message(model, where, exc, world, split)) from exc
            record.checked, record.unchecked = mode, verdict.unchecked
            record.output_rel_diff = verdict.output.error / max(
                tolerance.magnitude(ref.exact), 1e-30
            )
            whole = {n for n, o in watched_owner.items() if _keeps_replicated(_style_at(chosen, o))}
            refuse(verdict, model, set(sliced) | set(reduced), whole)
    finally:
        _check.restore(watched_params, saved)
        _check.forget_weights()
    guard_save_pretrained(model)  # HF's save_pretrained would write this rank's shards
    model.fastpar_plan = record
    return model
