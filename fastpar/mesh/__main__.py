"""``python -m fastpar.mesh --world-size 16 --tp 2 --pp 4 [--ep E] [--dp-shard S] [--dp-replicate R]
[--order O] [--json] [--check]``

``--world-size`` may be left out where ``--dp`` (or both ``--dp-shard`` and ``--dp-replicate``,
dp = dp-shard x dp-replicate) gives it: world = tp x cp x pp x dp.

Prints each rank's coordinates and every group of the layout. ``--check`` also starts
``--world-size`` CPU ranks (gloo), creates the groups for real and all-reduces over each one,
confirming every group reduces over exactly the ranks listed.
"""

from __future__ import annotations

import json
import sys
import time

from fastpar.cliutil import Parser
from fastpar.mesh.layout import DEFAULT_ORDER, GROUP_KINDS, MeshLayout, resolve_dp


def _check(layout: MeshLayout) -> int:
    from fastpar.launch import run_ranks
    from fastpar.mesh.check import group_sums, members

    t0 = time.perf_counter()
    results = run_ranks(
        group_sums,
        layout.world_size,
        layout.tp,
        layout.pp,
        layout.ep,
        layout.order,
        layout.cp,
        layout.dp_shard,
    )
    bad = []
    for rank, res in enumerate(results):
        for kind in GROUP_KINDS:
            expected = layout.group_of(kind, rank)
            ranks, bits = res[kind]
            got = members(bits) if bits is not None else []
            if ranks != expected or got != expected:
                bad.append(
                    f"rank {rank} {kind}: expected {expected}, mesh lists {ranks}, reduced over {got}"
                )
    dt = time.perf_counter() - t0
    if bad:
        print("\n".join(["check FAILED:", *bad]))
        return 1
    print(
        f"\ncheck ok: {layout.world_size} gloo ranks created every group and an all-reduce over "
        f"each reached exactly the listed ranks ({dt:.2f} s)"
    )
    return 0


def _world_size(args) -> int:
    """--world-size, or tp x cp x pp x dp where dp is given (--dp, or --dp-shard x
    --dp-replicate); ValueError for a contradiction or neither, naming the flags."""
    flags = ("--dp", "--dp-shard", "--dp-replicate")
    dp, _, _ = resolve_dp(args.dp, args.dp_shard, args.dp_replicate, flags)
    other = args.tp * args.cp * args.pp
    if args.world_size is None:
        if dp is None:
            raise ValueError(
                "give --world-size, or --dp (or both --dp-shard and --dp-replicate) to set it "
                "as tp x cp x pp x dp"
            )
        return other * dp
    if dp is not None and args.world_size != other * dp:
        raise ValueError(
            f"--world-size {args.world_size} is not tp x cp x pp x dp = {args.tp} x {args.cp} x "
            f"{args.pp} x {dp} = {other * dp}; give --world-size or the dp flags, or make them "
            f"agree"
        )
    return args.world_size


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="python -m fastpar.mesh", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--world-size",
        type=int,
        help="number of ranks (default tp x cp x pp x dp, from --dp or --dp-shard x --dp-replicate)",
    )
    ap.add_argument("--dp", type=int, help="data-parallel size (default world-size / (tp*cp*pp))")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size")
    ap.add_argument(
        "--dp-shard", type=int, help="hybrid sharding: ranks of dp sharding one copy (default dp)"
    )
    ap.add_argument(
        "--dp-replicate", type=int, help="hybrid sharding: copies (dp = dp-shard x dp-replicate)"
    )
    ap.add_argument(
        "--order",
        default=DEFAULT_ORDER,
        help=f"axis order, first fastest (default {DEFAULT_ORDER})",
    )
    ap.add_argument("--json", action="store_true", help="print the layout as JSON")
    ap.add_argument(
        "--check", action="store_true", help="create the groups on CPU ranks and test them"
    )
    args = ap.parse_args(argv)
    try:
        layout = MeshLayout(
            _world_size(args),
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            order=args.order,
            cp=args.cp,
            dp_shard=args.dp_shard,
            dp_replicate=args.dp_replicate,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {
            "world_size": layout.world_size,
            "sizes": {
                "tp": layout.tp,
                "cp": layout.cp,
                "pp": layout.pp,
                "dp": layout.dp,
                "ep": layout.ep,
                "expert-dp": layout.expert_dp,
                "dp-shard": layout.dp_shard,
                "dp-replicate": layout.dp_replicate,
            },
            "order": layout.order,
            "ranks": [layout.coords(r) for r in range(layout.world_size)],
            "groups": layout.groups,
        }
        print(json.dumps(doc, indent=1))
    else:
        print(layout.describe())
    return _check(layout) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
