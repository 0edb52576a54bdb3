#!/usr/bin/env bash
# The README's test command: set up (first run only), lint, then every tier. CI (.ci/run) runs
# exactly this, so every test runs on every landing:
#   CPU tier:          every parity, unit, fault, CLI, torchrun and compile test (multi-rank over
#                      gloo, on a pool of live ranks: fastpar/launch/pool.py), the costly ones too.
#   second path:       the parity-heavy files once more under ATEN_CPU_CAPABILITY=default (ATen's
#                      scalar kernels: other vector widths, other summation orders), so a verdict
#                      that holds on one CPU's kernels only fails here (docs/tolerances.md).
#   interpreter tier:  Triton kernels under TRITON_INTERPRET=1, in its own process (the
#                      variable must be set before any kernel is defined).
#   GPU tier:          pytest -m cuda, run by hand or by bench/gpu_check.py on a GPU machine.
# The tiers run as FASTPAR_TEST_SHARDS (default 1: the CPU tier is CPU-bound on 2 cores, two
# queues measured barely faster and load-sensitive tests suffer) queues at once: the CPU tier's files and the
# two other tiers split over the queues by their recorded seconds (scripts/split_tests.py);
# each line is prefixed with its queue, and every queue's summary is printed again at the end.
# Extra arguments: one CPU-tier pytest run with them (say a file or -k), no other tier.
# Switches (docs/switches.md's table lists every one): FASTPAR_TEST_QUICK (1: leave out the
# tests marked slow, for local work only; CI never sets it), FASTPAR_TEST_SHARDS,
# FASTPAR_DEBUG_CHECKS (on here for the CPU tier), FASTPAR_TEST_TIMEOUT (run_ranks' default
# timeout, seconds), FASTPAR_TEST_POOL (0: fork ranks for every call, no pool),
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
if [ "$#" -gt 0 ]; then
    echo "== CPU tier: pytest $*"
    exec python -m pytest -m "not cuda and not interpreter" "$@"
fi
# every test by default; FASTPAR_TEST_QUICK=1 leaves out those marked slow (inductor compiles,
# torchrun jobs, the costlier cases tests/slow_tier.txt lists) for a quicker local run
case "${FASTPAR_TEST_QUICK:-0}" in
    0) CPU=(python -m pytest -m "not cuda and not interpreter") ;;
    1) CPU=(python -m pytest -m "not cuda and not interpreter and not slow")
       echo "FASTPAR_TEST_QUICK=1: the tests marked slow are left out (CI runs them)" ;;
    *) echo "FASTPAR_TEST_QUICK=${FASTPAR_TEST_QUICK} must be 0 or 1 (1 leaves out the tests" \
           "marked slow)" >&2
       exit 2 ;;
esac

SHARDS="${FASTPAR_TEST_SHARDS:-1}"
if ! [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]]; then
    echo "FASTPAR_TEST_SHARDS=$SHARDS is not a positive number of queues: set it to 1 (one" \
        "tier after the other: the default) or 2 (one queue per core)" >&2
    exit 2
fi
# with two queues their ranks share the cores: give run_ranks' default wait room (tests that
# test a timeout pass their own)
if [ "$SHARDS" -gt 1 ]; then export FASTPAR_TEST_TIMEOUT="${FASTPAR_TEST_TIMEOUT:-240}"; fi

# The second kernel path: the tests whose verdict rests on the tolerance rule, from one layer to
# whole models (check_parallel, AGREE on 10 seeds, every HF family under parallelize and every data-
# parallel wrapper, MoE with EP and its grouped GEMMs, DDP, Zero3, pipelines, Llama,
# clipping). Inductor cannot build its C++ under this capability (a torch limitation): the
# compile tests stay out. tests/slow_tier.txt never names these.
SECOND_PATH=(
    tests/test_parity.py::test_the_readme_plan_agrees_for_every_seed
    tests/test_parity.py::test_check_parallel_on_a_model_defined_here
    tests/test_nn_linear.py tests/test_amp_norm.py tests/test_fp8_linear.py
    tests/test_nn_lora.py tests/test_lora_models.py
    tests/test_lora_peft.py::test_tp_matches_peft_single_process
    tests/test_moe_hf_blocks.py tests/test_moe_grouped_gemm.py
    tests/test_nn_parallelize_hf.py::test_training_under_every_data_parallel_wrapper[llama-tp2-dp2]
    tests/test_nn_parallelize_hf.py::test_training_under_every_data_parallel_wrapper[mistral-tp2-dp2]
    tests/test_nn_parallelize_hf.py::test_training_under_every_data_parallel_wrapper[qwen3_moe-tp2-dp2]
    tests/test_parallel_ddp.py::test_training_equals_single_process
    "tests/test_moe_tp.py::test_verify_deepseek_style_moe_at_dp2_ep2_tp2[llama-sp-etp-z2]"
    tests/test_models_llama.py::test_tensor_parallel_equals_single_process_on_every_rank
    tests/test_ops_documents.py tests/test_parallel_context_documents.py
    "tests/test_train_documents.py::test_every_gradient_on_every_rank_is_the_single_process_models[cp2-dp2]"
    tests/test_models_mtp.py::test_loss_and_gradients_equal_the_papers_definition
    "tests/test_models_mtp.py::test_every_gradient_on_every_rank_is_the_single_process_models[tp2-pp2-d2-untied]"
)
# the two extra jobs' seconds, for the split (scripts/split_tests.py)
JOBS=(second=100 interpreter=45)

LOGS="$(mktemp -d -t fastpar-tests-XXXXXX)"
trap 'rm -rf "$LOGS"' EXIT

queue() {  # queue K: its share of the CPU tier's files, then its extra jobs
    local k="$1" mine=() jobs=() line rc=0
    while IFS= read -r line; do
        case "$line" in
            "") ;;
            job:*) jobs+=("${line#job:}") ;;
            *) mine+=("$line") ;;
        esac
    done < <(python scripts/split_tests.py "$SHARDS" "$k" "${JOBS[@]}")
    if [ "${#mine[@]}" -gt 0 ]; then
        echo "== CPU tier, queue $k: ${#mine[@]} files"
        "${CPU[@]}" -p no:cacheprovider --durations=20 "${mine[@]}" || rc=1
    fi
    for job in "${jobs[@]}"; do
        if [ "$job" = second ]; then
            echo "== second CPU kernel path (ATEN_CPU_CAPABILITY=default): ${#SECOND_PATH[@]} selections"
            ATEN_CPU_CAPABILITY=default "${CPU[@]}" -p no:cacheprovider "${SECOND_PATH[@]}" || rc=1
        else
            echo "== interpreter tier (TRITON_INTERPRET=1)"
            local irc=0
            # only the files that use the marker: collecting the whole suite costs 40 s
            mapfile -t kernels < <(grep -l "mark\.interpreter" tests/test_*.py)
            TRITON_INTERPRET=1 python -m pytest -m interpreter -p no:cacheprovider "${kernels[@]}" \
                || irc=$?
            # pytest exits 5 when no test carries the marker; any other non-zero is a failure
            if [ "$irc" -ne 0 ] && [ "$irc" -ne 5 ]; then rc=1; fi
        fi
    done
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
