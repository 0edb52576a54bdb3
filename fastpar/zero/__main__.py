"""``python -m fastpar.zero --params 7.5e9 [--dp 1 8 64 ...] [--optimizer-state-dtype bf16]``:
bytes per rank at ZeRO stages."""

from __future__ import annotations

from fastpar.cliutil import Parser
from fastpar.optim.config import STATE_DTYPES, TORCH_STATE_DTYPES
from fastpar.zero.memory import adamw_state_bytes, estimate_memory


def main(argv: list[str] | None = None) -> None:
    ap = Parser(prog="python -m fastpar.zero", description=__doc__)
    ap.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 7.5e9")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--mode", choices=["paper", "fastpar"], default="paper")
    ap.add_argument(
        "--optimizer-state-dtype",
        choices=STATE_DTYPES,
        default="fp32",
        help="AdamW's moments: fp32 (K = 12 bytes a parameter) or bf16 (K = 8)",
    )
    args = ap.parse_args(argv)
    k = adamw_state_bytes(TORCH_STATE_DTYPES[args.optimizer_state_dtype])
    print(f"GB per rank for {args.params:.3g} parameters ({args.mode} model, K = {k})")
    print(f"{'DP':>6} {'baseline':>10} {'stage 1':>10} {'stage 2':>10} {'stage 3':>10}")
    for n in args.dp:
        row = [
            estimate_memory(args.params, n, s, optimizer_bytes=k, mode=args.mode).total / 1e9
            for s in range(4)
        ]
        print(f"{n:>6} " + " ".join(f"{v:>10.3g}" for v in row))


if __name__ == "__main__":
    main()
