"""What a data-parallel wrapper holds, saves and loads, over its flats (``FlatShard``): bytes held,
the same-layout state dict, and the checkpoint-pieces protocol (``fastpar.optim.pieces``); the
pieces a rank writes: docs/layouts.md ("The data-parallel family")."""

from __future__ import annotations

import torch
from torch import nn

from fastpar.optim.pieces import SCALAR_KEYS, keys_for, state_pieces


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def memory_bytes(dp) -> dict[str, int]:
    """Bytes this rank holds now: parameters (full buffers kept between steps, ZeRO-3 shards),
    gradients (buffers alive, reduced gradients outside them), fp32 masters (when separate from
    the parameters), optimizer state. ZeRO-3's full buffers gathered during forward / backward
    are in ``peak_gathered_bytes``."""
    params, grads = [], []
    for f in dp.flats:
        if f.shard is not None:
            params.append(f.shard)
        elif f.full is not None:
            params.append(f.full)
        else:  # gradient synchronisation only: the parameters are the module's own
            params += f.params
        grads.append(f.grad)
        if f.reduced is not None and f.reduced is not f.grad and not f.reduced_in_grad:
            grads.append(f.reduced)
    opt = dp.optimizer
    state = [] if opt is None else [v for s in opt.state.values() for v in s.values()]
    out = {
        "params": _nbytes(params),
        "grads": _nbytes(grads),
        "masters": _nbytes(f.master for f in dp.flats if f.master is not None and not f.aliased()),
        "optimizer": _nbytes(v for v in state if torch.is_tensor(v)),
    }
    out["total"] = sum(out.values())
    return out


def layout_signature(dp) -> list:
    """What must match for a state dict to load: each flat's unit, dtype, optimizer group,
    kind, sharding, padded size and parameter shapes."""
    return [
        (
            f.unit,
            str(f.dtype),
            f.param_group,
            f.expert,
            f.sharded,
            f.padded,
            [tuple(s) for s in f.shapes],
        )
        for f in dp.flats
    ]


def state_dict(dp) -> dict:
    """This rank's shard: masters, the inner optimizer's state, the scaler, the layout."""
    return {
        "stage": dp.stage,
        "dp_size": dp.dp_size,
        "dp_rank": dp.dp_rank,
        "layout": layout_signature(dp),
        "masters": [f.master.detach().clone() for f in dp.flats],
        "optimizer": dp.optimizer.state_dict(),
        "scaler": None if dp.scaler is None else dp.scaler.state_dict(),
        "skipped_steps": dp._skipped.clone(),
    }


def load_state_dict(dp, state: dict) -> None:
    """Resume on the same layout (same DP size and rank, same flats)."""
    mine = (dp.dp_size, dp.dp_rank, layout_signature(dp))
    if mine != (state["dp_size"], state["dp_rank"], state["layout"]):
        raise ValueError(
            f"this data-parallel state was saved by DP rank {state['dp_rank']} of "
            f"{state['dp_size']} with another layout; it loads only into the same layout (this "
            f"is rank {dp.dp_rank} of {dp.dp_size}). Reshard through a full checkpoint "
            "(fastpar.checkpoint) instead"
        )
    with torch.no_grad():
        for f, saved in zip(dp.flats, state["masters"], strict=True):
            f.master.copy_(saved)
    dp.optimizer.load_state_dict(state["optimizer"])
    if dp.scaler is not None and state["scaler"] is not None:
        dp.scaler.load_state_dict(state["scaler"])
    dp._skipped.copy_(state["skipped_steps"])
    dp.refresh_params()


def checkpoint_pieces(dp) -> list[tuple[nn.Parameter, str, torch.Tensor, int, int]]:
    """(p, key, values, start, stop) for every parameter piece this rank writes (module
    docstring)."""
    out: list = []
    if dp.optimizer is None:  # gradient synchronisation only: the optimizer is the caller's
        return out
    for f in dp.flats:
        if (not f.sharded and f.rank != 0) or f.replicate_rank != 0:  # one writer per piece
            continue
        master = f.master.detach()
        state = dp.optimizer.state.get(f.master, {})
        for o in f.owned():
            p = f.params[o.index]
            out.append((p, "param", master[o.in_shard], o.start, o.stop))
            pieces = state_pieces(p, state, master.shape, o.in_shard, o.start)
            out += [piece for piece in pieces if o.first or piece[1] not in SCALAR_KEYS]
    return out


@torch.no_grad()
def load_checkpoint_pieces(dp, lookup) -> None:
    """Fill the masters and the inner optimizer's state from ``lookup(p, key)`` (whole local
    tensors: each rank copies what it owns), then rebuild the parameters. A flat's "step" is
    that of its first parameter with one."""
    opt = dp.optimizer
    if opt is None:
        return
    index = {id(q): i for i, q in enumerate(q for g in opt.param_groups for q in g["params"])}
    saved, changed = opt.state_dict(), False
    for f in dp.flats:
        entry: dict = {}
        owned = {o.index: o for o in f.owned()}
        for i, p in enumerate(f.params):
            numel = f.shapes[i].numel()
            o = owned.get(i)
            for key in ["param", *keys_for(lookup, p, opt.state.get(f.master))]:
                t = lookup(p, key)
                if t is None:
                    continue
                t = t.detach().reshape(-1)
                if key not in SCALAR_KEYS and t.numel() != numel:
                    raise ValueError(
                        f"lookup returned {t.numel()} elements for {key!r} of a parameter of "
                        f"local shape {tuple(f.shapes[i])} ({numel} elements)"
                    )
                if key == "param" and f.full is not None and f.shard is None:
                    f.view(f.full, i).copy_(t.view(f.shapes[i]))  # kept: the whole parameter
                if o is None:  # none of it is this rank's
                    continue
                if key in SCALAR_KEYS:
                    entry.setdefault(key, t.reshape(()).clone())
                elif key == "param":
                    f.master[o.in_shard].copy_(t[o.start : o.stop])
                else:
                    if key not in entry:
                        entry[key] = torch.zeros(f.shard_len, dtype=t.dtype, device=f.master.device)
                    entry[key][o.in_shard] = t[o.start : o.stop]
        if entry:
            at = index[id(f.master)]
            saved["state"][at] = {**saved["state"].get(at, {}), **entry}
            changed = True
    if changed:
        opt.load_state_dict(saved)
    for f in dp.flats:  # shards and replicated buffers from the masters (kept full buffers hold
        if f.master is None or f.aliased():  # the values already)
            continue
        if f.shard is not None:
            f.shard.copy_(f.master)
        elif not f.sharded:
            f.full.copy_(f.master)
