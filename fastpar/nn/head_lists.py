"""Per-head module lists: an attention module that keeps one module per head in an
``nn.ModuleList`` (StableLM's ``qk_layernorm`` norms, paired with the heads by ``zip``) must, once
its heads are split, keep only this rank's heads' modules: rank r keeps entries
[r·h/tp, (r+1)·h/tp), under their dense names (``norms.2`` stays ``norms.2``)."""

from __future__ import annotations

from torch import nn

from fastpar.mesh.ranks import group_rank


class HeadShare(nn.ModuleList):
    """This rank's entries of a per-head ``ModuleList``, under their dense names; indexed by
    position (``share[0]`` is this rank's first head's module)."""

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return list(self._modules.values())[idx]


def slice_head_lists(model, modules, parents, counts, tp_group, world: int) -> list[str]:
    """In each split attention module ``parents`` (name -> its dense head counts, a set of
    ints), replace every ``nn.ModuleList`` whose length is one of those counts by this rank's
    share of it (an owner's integer attribute equal to that length is divided too). Returns the
    names of the parameters kept, which this rank alone holds."""
    if world == 1:
        return []
    rank, kept = group_rank(tp_group), []
    for parent in parents:
        top = modules[parent] if parent else model
        heads = counts.get(parent, set())
        for name, owner in list(top.named_modules()):
            for attr, child in list(owner.named_children()):
                if not isinstance(child, nn.ModuleList) or len(child) not in heads:
                    continue
                n = len(child)
                if n % world:
                    raise ValueError(
                        f"{'.'.join(x for x in (parent, name, attr) if x)!r} holds one module per "
                        f"head ({n}), not divisible by the TP size {world}"
                    )
                per = n // world
                part = HeadShare()
                for i in range(rank * per, (rank + 1) * per):
                    part.add_module(str(i), child[i])
                setattr(owner, attr, part)
                for a, v in list(vars(owner).items()):
                    if isinstance(v, int) and not isinstance(v, bool) and v == n:
                        setattr(owner, a, per)
                prefix = ".".join(x for x in (parent, name, attr) if x)
                kept += [f"{prefix}.{p}" for p, _ in part.named_parameters()]
    return kept
