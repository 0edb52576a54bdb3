#!/usr/bin/env bash
# The README's test command: set up (first run only), lint, then the test tiers.
#   CPU tier:          every parity and unit test (multi-rank over gloo), in one pytest run.
#   interpreter tier:  Triton kernels under TRITON_INTERPRET=1, in its own process (the
#                      variable must be set before any kernel is defined).
#   GPU tier:          pytest -m cuda, run by hand or by bench/gpu_check.py on a GPU machine.
# Extra arguments go to the CPU-tier pytest run. Switches (the README's table lists every one):
# FASTPAR_DEBUG_CHECKS (on here for the CPU tier), FASTPAR_TEST_TIMEOUT (run_ranks' default
# timeout, seconds), and setup.sh's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"

echo "== lint (ruff check, ruff format --check)"
ruff check .
ruff format --check .

echo "== interpreter tier (TRITON_INTERPRET=1)"
set +e
TRITON_INTERPRET=1 python -m pytest -m interpreter -p no:cacheprovider
rc=$?
set -e
# pytest exits 5 when no test carries the marker yet; any other non-zero is a failure.
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi

echo "== CPU tier"
# with the cross-rank debug checks on (fastpar.debug; about +8 % on the most TP-heavy files)
export FASTPAR_DEBUG_CHECKS="${FASTPAR_DEBUG_CHECKS:-1}"
python -m pytest -m "not cuda and not interpreter" "$@"
