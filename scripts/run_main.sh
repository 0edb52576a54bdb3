#!/usr/bin/env bash
# The README's main job: set up (first run only), then
#   1. train a small byte-level BPE tokenizer on the embedded corpus (offline, seconds);
#   2. train a Llama-class model (GQA, RoPE, SwiGLU, RMSNorm, Qwen3 q/k-norm, a SwiGLU MoE block
#      every 2nd layer) on 8 CPU ranks with every parallelism at once: DP 2 x TP 2 x PP 2, EP 2,
#      ZeRO-1, 1F1B; the loss falls; the last step is checkpointed;
#   3. export the checkpoint to a Hugging Face directory (Qwen3-MoE), load it with transformers,
#      check that its logits equal fastpar's, and generate a few tokens with both;
#   4. prove a layout equal to the single-process model.
# Extra arguments go to the trainer (step 2). FASTPAR_RUN_DIR keeps the run's files (default: a
# temporary directory, removed at the end).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ -n "${FASTPAR_RUN_DIR:-}" ]; then  # a new run directory inside it each time
    RUN="$FASTPAR_RUN_DIR/run-$(date +%Y%m%d-%H%M%S)"
    mkdir -p "$RUN"
else
    RUN="$(mktemp -d -t fastpar-main-XXXXXX)"
    trap 'rm -rf "$RUN"' EXIT
fi
LLAMA=(--model llama --kv-heads 2 --qk-norm)

python -m fastpar.info
echo
python -m fastpar.tokenizer --vocab-size 512 --out "$RUN/tokenizer.json"
echo
python -m fastpar.train "${LLAMA[@]}" --tokenizer "$RUN/tokenizer.json" --steps 120 --lr 1e-2 \
    --log-every 10 --checkpoint-dir "$RUN/ckpt" "$@"
echo
python -m fastpar.export "$RUN/ckpt" "$RUN/hf" --check --generate 16 --prompt "Beautiful is better than"
echo
python -m fastpar.verify "${LLAMA[@]}" --tp 2 --pp 2 --dp 2 --ep 2 --zero 1 --steps 3
