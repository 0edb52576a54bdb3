"""What ``parallelize`` says when its check fails: the disagreeing quantity and its likely
cause (``refuse``), or, when the parallel model raised on the probe input, the module that
raised (``tracking``) and the fix that applies (``failed_message``; docs/hf.md, "The check")."""

from __future__ import annotations

import re

from torch import nn

from fastpar.nn.check import Verdict


def refuse(verdict: Verdict, model: nn.Module, per_head, whole=()) -> None:
    """ValueError naming the first disagreeing quantity and its likely cause; None if all
    agree. ``per_head``: the parameters that see only this rank's heads; ``whole``: those of
    modules planned "replicate" (whole activations), the likeliest source of a shared one."""
    out = verdict.ratios.get("output", 0.0)
    bad = [n for n, r in verdict.ratios.items() if n != "output" and r > 1]
    spread = [n for n, r in verdict.spread.items() if r > 1]
    if out <= 1 and not bad and not spread:
        return
    # a per-head parameter that disagrees is the likeliest culprit; else the one nearest the
    # output (last in the model's order), nearest the defect
    wrong = list(dict.fromkeys(bad + spread))
    heads = [n for n in wrong if n in per_head]
    shared = [n for n in wrong if n in whole]
    name = heads[0] if heads else shared[-1] if shared else wrong[-1] if wrong else None
    cause = (
        "a per-head parameter (a module kept per head, e.g. a ModuleList of norms paired "
        "with the heads by position) that the split pairs with another rank's heads: "
        "slice it with the heads, or leave that attention module whole"
    )
    if not heads:
        cause = (
            "the parameters upstream of a module whose output is shared by every local head (as "
            "MLA's rope key k_rot, broadcast into each head) get only this rank's heads' share "
            "of its gradient: that activation needs a copy-to-region (identity forward, "
            "all-reduce backward; fastpar.comm.copy_to_region) where it enters the heads (the "
            "probe gives it to an nn.Linear whose last output features the heads read; plan "
            "another such module ('shared_key', {'features': k})), or leave that attention "
            "module whole (do not split it)"
        )
    others = [n for n in wrong if n != name]
    listed = f"; {len(others)} more disagree, e.g. {others[:3]}" if others else ""
    grad = ""
    if name is not None:
        across = verdict.spread.get(name, 0.0)
        grad = (
            f"the gradient of {name!r} differs from the dense model's ({verdict.grads[name]})"
            + (
                f" and its copies differ across the TP ranks ({across:.3g} x its bound)"
                if across > 1
                else ""
            )
            + listed
        )
    if out > 1:
        raise ValueError(
            f"parallelize: on the probe input the parallel model's output differs from the dense "
            f"model's ({verdict.output}; error/bound {out:.3g} over the TP ranks): the plan changes "
            f"what {type(model).__name__} computes (a head count or width the model reads "
            "elsewhere? pass heads=)"
            + (f"; {grad}. Likely cause: {cause}" if heads else (f"; {grad}" if grad else ""))
        )
    raise ValueError(
        f"parallelize: on the probe input {grad}. Likely cause: {cause}. The forward may agree "
        "while the gradients do not; check='forward' skips this check (not advised)"
    )


class tracking:
    """Within it, ``where`` (the object it gives) lists the modules running, outermost first:
    after an exception, the path down to the module that raised."""

    def __init__(self, model: nn.Module):
        self.model, self.stack, self.handles = model, [], []

    def __enter__(self) -> list[tuple[str, nn.Module]]:
        for name, m in self.model.named_modules():

            def enter(mod, _args, name=name):
                self.stack.append((name, mod))

            def leave(mod, _args, _out):
                if self.stack:
                    self.stack.pop()

            self.handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
        return self.stack

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


_RESHAPE = ("shape '", "is invalid for input of size", "view size", "expanded size", "must match")
_FUSED = ("qkv", "query_key_value", "gate_up", "c_attn", "w_pack", "fused", "in_proj")
_DIVIDED = ("num_heads", "n_head", "num_attention_heads", "num_key_value_heads", "n_kv_head")
_NOT_DIVIDED = ("head_dim", "max_position_embeddings", "rotary_ndims", "rope_dim")


def _undivided(module: nn.Module, world: int) -> list[str]:
    """Integer attributes of ``module`` the split may have left undivided (head counts and
    widths; those parallelize divides, and per-head sizes, left out), head counts first."""
    names = [
        a
        for a, v in vars(module).items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v > 1
        and v % world == 0
        and not a.startswith("_")
        and a not in _DIVIDED + _NOT_DIVIDED
        and any(k in a for k in ("head", "dim", "size", "emb", "width"))
    ]
    return sorted(names, key=lambda a: "head" not in a)


def failed_message(model: nn.Module, where, exc: Exception, world: int, split=()) -> str:
    """What to say when the parallel model raised on the probe input where the dense one ran:
    the module that raised, the likely cause and the fix that applies (``split``: the planned
    modules whose output is split)."""
    if isinstance(exc, ValueError) and str(exc).startswith("parallelize:"):
        return str(exc)
    name, module = where[-1] if where else ("", model)
    msg = str(exc)
    at = f"module {name or '<model>'!r} ({type(module).__name__})"
    nums = {int(x) for x in re.findall(r"\d+", msg)}
    # the enclosing module whose projections the plan splits (the attention or MLP block)
    block = next(
        (n for n, _ in reversed(where) if any(s.rpartition(".")[0] == n for s in split)), None
    )
    fused = [
        s
        for s in split
        if s.rpartition(".")[0] == block and any(k in s.rpartition(".")[2].lower() for k in _FUSED)
    ]
    wide = [
        (p_name, p.shape[-1])
        for p_name, p in module.named_parameters(recurse=False)
        if p.dim() and p.shape[-1] % world == 0 and {p.shape[-1], p.shape[-1] // world} <= nums
    ]
    whole = f"leave {block or 'the block'!r} whole (drop its projections from the plan)"
    attrs, owner = [], name
    for n, m in reversed(where):
        if attrs := _undivided(m, world):
            owner = n
            break
    reshape = any(k in msg for k in _RESHAPE)
    if wide:
        p_name, width = wide[0]
        hint = (
            f"{name!r} applies its {p_name!r} of width {width} (every head's features) to this "
            f"rank's share ({width // world}): a norm or scale over the whole projection "
            f"(statistics across all heads) cannot be split exactly; {whole}"
        )
    elif reshape and attrs and ("head" in attrs[0] or not fused):
        pattern = f"*.{owner.rpartition('.')[2]}" if owner else ""
        hint = (
            "it reshapes a split activation with a head count or width the split did not "
            f"divide: pass heads={{{pattern!r}: [{attrs[0]!r}]}} (candidates on {owner!r}: "
            f"{attrs})"
            + (
                f"; if {fused[0]!r} is a fused q|k|v, plan it ('column', {{'fused': 3}})"
                if fused
                else ""
            )
            + f"; or {whole}"
        )
    elif fused:
        hint = (
            f"{fused[0]!r} is a fused projection (q|k|v or gate|up in one linear): a plain "
            "'column' split gives each rank a contiguous part of it, not its share of every "
            "block; plan it ('column', {'fused': k}) when its k blocks are of equal width (its "
            f"row partner stays 'row'), else {whole}"
        )
    elif reshape:
        hint = (
            "it reshapes a split activation with a head count or width the split did not "
            f"divide: pass heads= naming the attribute to divide; or {whole}"
        )
    else:
        hint = f"pass heads= naming any head count or width the model reads, or {whole}"
    return (
        f"parallelize: the parallel {type(model).__name__} failed on the probe input where the "
        f"dense one ran, in {at}: {type(exc).__name__}: {msg}. Likely cause: {hint}"
    )
