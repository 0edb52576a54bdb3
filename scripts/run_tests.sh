#!/usr/bin/env bash
# The README's test command: set up (first run only), lint, then the test tiers.
#   CPU tier:          every parity and unit test (multi-rank over gloo).
#   second path:       the parity-heavy files once more under ATEN_CPU_CAPABILITY=default (ATen's
#                      scalar kernels: other vector widths, other summation orders), so a verdict
#                      that holds on one CPU's kernels only fails here (docs/tolerances.md).
#   interpreter tier:  Triton kernels under TRITON_INTERPRET=1, in its own process (the
#                      variable must be set before any kernel is defined).
#   GPU tier:          pytest -m cuda, run by hand or by bench/gpu_check.py on a GPU machine.
# The tiers run as FASTPAR_TEST_SHARDS (default 2) queues at once: the CPU tier's files split
# over the queues (every other file), the second path and the interpreter tier after them;
# each line is prefixed with its queue, and every queue's summary is printed again at the end.
# Extra arguments: one CPU-tier pytest run with them (say a file or -k), no other tier.
# Switches (the README's table lists every one): FASTPAR_TEST_SHARDS, FASTPAR_DEBUG_CHECKS (on
# here for the CPU tier), FASTPAR_TEST_TIMEOUT (run_ranks' default timeout, seconds),
# FASTPAR_TEST_SEED (tests/conftest.py), and setup.sh's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"

echo "== lint (ruff check, ruff format --check)"
ruff check .
ruff format --check .

# with the cross-rank debug checks on (fastpar.debug; about +8 % on the most TP-heavy files)
export FASTPAR_DEBUG_CHECKS="${FASTPAR_DEBUG_CHECKS:-1}"
CPU=(python -m pytest -m "not cuda and not interpreter")

if [ "$#" -gt 0 ]; then
    echo "== CPU tier: pytest $*"
    exec "${CPU[@]}" "$@"
fi

SHARDS="${FASTPAR_TEST_SHARDS:-2}"
if ! [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]]; then
    echo "FASTPAR_TEST_SHARDS=$SHARDS is not a positive number of queues: set it to 1 (one" \
        "tier after the other) or 2 (the default, one queue per core)" >&2
    exit 2
fi
# ranks of two queues share the cores: give run_ranks' default wait room (tests that test a
# timeout pass their own)
export FASTPAR_TEST_TIMEOUT="${FASTPAR_TEST_TIMEOUT:-240}"

# The second kernel path: the files whose verdict rests on the tolerance rule, from one layer
# to whole models (every HF family, every wrapper, pipelines, MoE, check_parallel). Inductor
# cannot build its C++ under this capability (a torch limitation), so compile tests stay out.
SECOND_PATH=(
    tests/test_parity.py tests/test_nn_linear.py tests/test_nn_embedding.py
    tests/test_nn_parallelize.py tests/test_nn_parallelize_hf.py tests/test_nn_parallelize_moe.py
    tests/test_moe_grouped_gemm.py tests/test_moe_hf_blocks.py tests/test_moe_tp.py
    tests/test_parallel_ddp.py tests/test_zero3.py tests/test_parallel_pipeline.py
    tests/test_models_llama.py tests/test_amp_norm.py tests/test_ops_cross_entropy.py
)

mapfile -t FILES < <(ls tests/test_*.py | sort)
LOGS="$(mktemp -d -t fastpar-tests-XXXXXX)"
trap 'rm -rf "$LOGS"' EXIT

queue() {  # queue K: its share of the CPU tier, then (K = 0) the second path, (K = 1) the interpreter
    local k="$1" mine=() i rc=0
    for i in "${!FILES[@]}"; do
        if [ $((i % SHARDS)) -eq "$k" ]; then mine+=("${FILES[$i]}"); fi
    done
    echo "== CPU tier, queue $k: ${#mine[@]} of ${#FILES[@]} files"
    "${CPU[@]}" -p no:cacheprovider "${mine[@]}" || rc=1
    if [ "$k" -eq 0 ] || [ "$SHARDS" -eq 1 ]; then
        echo "== second CPU kernel path (ATEN_CPU_CAPABILITY=default): ${#SECOND_PATH[@]} files"
        ATEN_CPU_CAPABILITY=default "${CPU[@]}" -p no:cacheprovider "${SECOND_PATH[@]}" || rc=1
    fi
    if [ "$k" -eq 1 ] || [ "$SHARDS" -eq 1 ]; then
        echo "== interpreter tier (TRITON_INTERPRET=1)"
        local irc=0
        TRITON_INTERPRET=1 python -m pytest -m interpreter -p no:cacheprovider || irc=$?
        # pytest exits 5 when no test carries the marker; any other non-zero is a failure
        if [ "$irc" -ne 0 ] && [ "$irc" -ne 5 ]; then rc=1; fi
    fi
    return "$rc"
}

pids=()
for ((k = 0; k < SHARDS; k++)); do
    (queue "$k" 2>&1 | tee "$LOGS/queue-$k.log" | sed -u "s/^/[q$k] /"; exit "${PIPESTATUS[0]}") &
    pids+=("$!")
done
failed=0
for k in "${!pids[@]}"; do
    wait "${pids[$k]}" || failed=1
done
echo "== summary"
for ((k = 0; k < SHARDS; k++)); do
    grep -E "^== |^(FAILED|ERROR) |^=+ .*(passed|failed|error|no tests ran).* =+$" \
        "$LOGS/queue-$k.log" | sed "s/^/[q$k] /" || true
done
if [ "$failed" -ne 0 ]; then
    echo "run_tests: a tier failed (see the FAILED lines above)" >&2
    exit 1
fi
echo "run_tests: every tier passed"
