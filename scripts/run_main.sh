#!/usr/bin/env bash
# The README's main job: set up (first run only), then show the most complete thing fastpar
# does today: the parallel layout of a 16-rank job (TP=2, PP=4, EP=2), and then the same
# groups created for real on 8 CPU ranks (gloo) and checked with an all-reduce in each.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
python -m fastpar.info
python -m fastpar.mesh --world-size 16 --tp 2 --pp 4 --ep 2 "$@"
python -m fastpar.mesh --world-size 8 --tp 2 --pp 2 --ep 2 --check
