#!/usr/bin/env bash
# The README's main job: set up (first run only), then train the default GPT on 8 CPU ranks with
# every parallelism at once (DP 2 x TP 2 x PP 2, EP 2 MoE layers, ZeRO-1, 1F1B), showing the loss
# fall, and prove a layout equal to the single-process model. Extra arguments go to the trainer.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
python -m fastpar.info
echo
python -m fastpar.train "$@"
echo
python -m fastpar.verify --tp 2 --pp 2 --dp 2 --ep 2 --zero 1 --steps 3
