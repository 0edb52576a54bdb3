"""Shared set-up for ``pytest bench/``: every saved result records device, versions and commit;
a quick default selection (the rest marked ``full``); pytest-benchmark's table in 100 columns.

Run:  pytest bench/ --benchmark-json=bench/results/<name>.json      (the quick selection)
      FASTPAR_BENCH_FULL=1 pytest bench/ ...                         (every benchmark)
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

import fastpar

BENCH = Path(__file__).resolve().parent


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        return "unknown"


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["fastpar"] = fastpar.__version__
    machine_info["torch"] = torch.__version__
    machine_info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    machine_info["commit"] = _commit()


# -- the quick default selection ------------------------------------------------------------------
#: Every benchmark not named here is marked ``full``: ``pytest bench/`` runs only these (one or
#: more cases of every benchmark file, 95-240 s on 2 cores), and
#: ``FASTPAR_BENCH_FULL=1`` (or any ``-m`` expression, or a node id given on the command line)
#: runs what it names. docs/benchmarks.md describes the selection.
QUICK = {
    "test_bench_adamw.py": [
        "test_adamw_step[fastpar-N1M]",
        "test_adamw_step[torch_fused-N1M]",
        "test_multi_tensor_table_prep[cached]",
        "test_multi_tensor_launch_host_time[cached]",
    ],
    "test_bench_allreduce_teaching.py": ["test_server_vs_ring[2]"],
    "test_bench_context.py": [
        "test_ring_attention_memory_and_hidden_transfer[2]",
        "test_torch_context_parallel_peer",
    ],
    "test_bench_cross_entropy.py": [
        "test_cross_entropy[fastpar-V8192-N512-full]",
        "test_cross_entropy[torch-V8192-N512-full]",
    ],
    "test_bench_ddp_zero.py": [
        "test_against_pytorch_peer[fastpar-ddp-torch-ddp-2]",
        "test_against_pytorch_peer[fastpar-zero2-torch-fsdp2-2]",
        "test_memory_and_traffic_planned_vs_measured[1]",
    ],
    "test_bench_documents.py": [
        "test_document_attention[docs8]",
        "test_causal_work_balance[2]",
    ],
    "test_bench_flight.py": [
        "test_train_step_with_and_without_the_recorder[tp2]",
        "test_cost_per_collective",
        "test_notes_on_and_off_step_by_step[tp2]",
    ],
    "test_bench_fp8_cast.py": [
        "test_fp8_quantize[fastpar-rowwise-1024x1024]",
        "test_fp8_quantize[torch-rowwise-1024x1024]",
    ],
    "test_bench_fp8_linear.py": [
        "test_linear_step[bf16]",
        "test_linear_step[tensorwise]",
        "test_linear_step[rowwise]",
        "test_linear_step[blockwise]",
    ],
    "test_bench_parallelize_check.py": ["test_check_cost_over_the_build[4M-4layers]"],
    "test_bench_harness.py": [
        "test_fork_noop[2]",
        "test_fork_noop[8]",
        "test_pool_noop[2]",
        "test_pool_noop[8]",
        "test_pool_full_mesh[8]",
        "test_fork_full_mesh[8]",
        "test_fork_full_mesh[4]",
        "test_fork_tp1_mesh[2]",
    ],
    "test_bench_hsdp.py": ["test_hsdp_against_fsdp2_hsdp[512]"],
    "test_bench_linear_cross_entropy.py": [
        "test_linear_cross_entropy[fused-V32768-N4096-H256-forward]",  # each full case: 70-270 s
    ],
    "test_bench_muon.py": ["test_muon_step[tp2]", "test_muon_step[dp2-zero1]"],
    "test_bench_moe_grouped.py": ["test_moe_grouped_experts[cpu-E8-H256-F512-T1024-balanced-mlp]"],
    "test_bench_moe_layer.py": ["test_moe_layer_step[2-dropless]"],
    "test_bench_moe_overlap.py": [
        "test_hidden_fraction[2-python]",
        "test_hidden_fraction_one_gpu[2]",
    ],
    "test_bench_moe_permute.py": [
        "test_permute[fastpar-T2048-H256-E8-k2-dropless-forward]",
        "test_permute[torch-T2048-H256-E8-k2-dropless-forward]",
        "test_unpermute[fastpar-T2048-H256-E8-k2-dropless-forward]",
        "test_unpermute[torch-T2048-H256-E8-k2-dropless-forward]",
    ],
    "test_bench_optim_state_dtype.py": [
        "test_state_bytes_and_step_time[1]",
        "test_fused_adamw_step[N1M]",
    ],
    "test_bench_pipeline.py": [
        "test_bubble_table[2-1f1b]",
        "test_activation_memory[1f1b-False]",
        "test_against_torch_pipelining[2-1f1b]",
    ],
    "test_bench_pipeline_schedules.py": [
        "test_bubble_against_theory[interleaved-v2-2]",
        "test_interleaved_bubble_beside_torch[2-2]",
        "test_activation_memory_per_rank[interleaved-v2]",
        "test_against_torch_interleaved_1f1b[2]",
        "test_against_torch_zero_bubble[2]",
    ],
    "test_bench_recompute.py": ["test_recompute_policies"],
    "test_bench_ring_documents.py": ["test_ring_attention_documents[docs8]"],
    "test_bench_tp_layers.py": ["test_mlp_fastpar_vs_dtensor[256-512-2]"],
    "test_bench_train.py": ["test_train_step_throughput[tp2-pp2-dp2-ep2]"],
    "test_bench_train_gpu.py": [  # CUDA only: skipped on a CPU
        "test_llama_1p7b_step_on_one_gpu[bf16]",
        "test_llama_1p7b_step_on_one_gpu[fp8-tensorwise]",
    ],
    "test_bench_unscale_norm.py": [
        "test_unscale_norm[fastpar-T100-E1e6-fp32]",
        "test_unscale_norm[torch_two_pass-T100-E1e6-fp32]",
        "test_launch_host_time[cached]",
    ],
    "test_bench_zero3.py": [
        "test_zero3_against_fsdp2[2]",
        "test_memory_and_traffic_planned_vs_measured_stage3",
    ],
}
FULL_ENV = "FASTPAR_BENCH_FULL"


def _quick(item) -> bool:
    return item.name in QUICK.get(item.path.name, ())


def _everything(config) -> bool:
    """Whether the run asked for more than the quick set: the variable, a ``-m`` expression
    (``-m full``: the rest only), or a node id on the command line (it runs as named)."""
    if os.environ.get(FULL_ENV, "0").strip() not in ("", "0"):
        return True
    return bool(config.getoption("markexpr")) or any("::" in a for a in config.args)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent == BENCH and not _quick(item):
            item.add_marker(pytest.mark.full)
    if _everything(config):
        return
    keep = [i for i in items if i.get_closest_marker("full") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


# -- pytest-benchmark's table within 100 columns ------------------------------------------------
WIDTH = 100
#: the columns shown unless --benchmark-columns is given (the plugin's default is ten: 230 wide)
COLUMNS = ["min", "median", "rounds"]
NAME_WIDTH = 40  # the rest of 100 columns: min and median 22 each (value and ratio), rounds 8


def short_name(bench: dict) -> str:
    """A benchmark's name without ``test_``, its middle cut to fit ``NAME_WIDTH`` (the saved
    JSON keeps the full name)."""
    name = bench["name"].removeprefix("test_")
    if len(name) <= NAME_WIDTH:
        return name
    head = (NAME_WIDTH - 2) // 2
    return name[:head] + ".." + name[len(name) - (NAME_WIDTH - 2 - head) :]


class _Fitted:
    """The terminal reporter as pytest-benchmark's table sees it: a line written whole that is
    longer than ``WIDTH`` (the legend) is wrapped, indented as it was."""

    def __init__(self, tr):
        self._tr = tr

    def write_line(self, line, **kw):
        line = str(line)
        if len(line) <= WIDTH or not line.startswith(" "):
            return self._tr.write_line(line, **kw)
        indent = " " * (len(line) - len(line.lstrip()))
        for part in textwrap.wrap(line, WIDTH, subsequent_indent=indent + "  "):
            self._tr.write_line(part, **kw)

    def __getattr__(self, name):
        return getattr(self._tr, name)


@pytest.hookimpl(trylast=True)  # after pytest-benchmark made its session
def pytest_configure(config):
    bs = getattr(config, "_benchmarksession", None)
    if bs is None:
        return
    if "--benchmark-columns" not in " ".join(config.invocation_params.args):
        bs.columns = list(COLUMNS)
    if config.getoption("benchmark_name") == "normal":  # the plugin's default
        bs.name_format = short_name
    display = bs.display
    bs.display = lambda tr: display(_Fitted(tr))
