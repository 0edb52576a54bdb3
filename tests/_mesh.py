"""The mesh of a test's ranks, built inside the rank function (``run_ranks`` starts the ranks;
their process group exists only there):

    def _check() -> None:
        mesh = make_mesh(tp=2, dp=2)        # 4 ranks: TP 2 x DP 2, refused on another world
        mesh = make_mesh(pp="world")        # one pipeline stage per rank, whatever the world

The tests of ``ParallelMesh`` itself (tests/test_mesh_*.py, tests/test_mesh_bridge.py) build it by
hand.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fastpar import ParallelMesh

WORLD = "world"
"""A size of ``make_mesh``: the whole world along that dimension."""


def make_mesh(
    tp: int | str = 1,
    pp: int | str = 1,
    ep: int | str = 1,
    *,
    cp: int = 1,
    dp: int | None = None,
    **kwargs: Any,
) -> ParallelMesh:
    """``ParallelMesh(tp, pp, ep, cp=cp, **kwargs)`` over this rank's world (``order``,
    ``timeout`` pass through). ``"world"`` for tp, pp or ep: the world size. ``dp``: the data-
    parallel size the test means; the world must then be tp · cp · pp · dp, else ValueError."""
    world = dist.get_world_size()
    tp, pp, ep = (world if s == WORLD else s for s in (tp, pp, ep))
    if dp is not None and tp * cp * pp * dp != world:
        raise ValueError(
            f"make_mesh(tp={tp}, cp={cp}, pp={pp}, dp={dp}) needs {tp * cp * pp * dp} ranks, "
            f"the test runs {world}: start it on that many ranks or change the sizes"
        )
    return ParallelMesh(tp, pp, ep, cp=cp, **kwargs)
