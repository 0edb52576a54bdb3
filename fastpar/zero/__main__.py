"""``python -m fastpar.zero --params 7.5e9 [--dp 1 8 64 ...] [--dp-replicate R]
[--optimizer-state-dtype bf16]``: bytes per rank at ZeRO stages. Under hybrid sharding
(``--dp-replicate R``) each ``--dp`` value is the whole data-parallel size and the state is
sharded over its dp / R ranks of a shard group (dp-shard · cp): the replicas hold the same
bytes, so a rank's bytes are those of full sharding over dp / R."""

from __future__ import annotations

from fastpar.cliutil import Parser
from fastpar.optim.config import STATE_DTYPES, TORCH_STATE_DTYPES
from fastpar.zero.memory import adamw_state_bytes, estimate_memory


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="python -m fastpar.zero", description=__doc__)
    ap.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 7.5e9")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument(
        "--dp-replicate",
        type=int,
        default=1,
        metavar="R",
        help="hybrid sharding: R copies of the shards; each --dp shards over dp / R (default 1)",
    )
    ap.add_argument("--mode", choices=["paper", "fastpar"], default="paper")
    ap.add_argument(
        "--optimizer-state-dtype",
        choices=STATE_DTYPES,
        default="fp32",
        help="AdamW's moments: fp32 (K = 12 bytes a parameter) or bf16 (K = 8)",
    )
    args = ap.parse_args(argv)
    r = args.dp_replicate
    bad = [n for n in args.dp if r < 1 or n % r]
    if bad:
        ap.error(f"--dp-replicate {r} must divide every --dp value; {bad[0]} is not a multiple")
    hybrid = f", dp-replicate {r}: sharded over dp / {r}" if r > 1 else ""
    k = adamw_state_bytes(TORCH_STATE_DTYPES[args.optimizer_state_dtype])
    print(f"GB per rank for {args.params:.3g} parameters ({args.mode} model, K = {k}{hybrid})")
    print(f"{'DP':>6} {'baseline':>10} {'stage 1':>10} {'stage 2':>10} {'stage 3':>10}")
    for n in args.dp:
        row = [
            estimate_memory(
                args.params, n if s == 0 else n // r, s, optimizer_bytes=k, mode=args.mode
            ).total
            / 1e9
            for s in range(4)
        ]
        print(f"{n:>6} " + " ".join(f"{v:>10.3g}" for v in row))


if __name__ == "__main__":
    main()
