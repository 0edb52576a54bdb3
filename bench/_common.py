"""Helpers shared by the kernel benchmarks: peak HBM bandwidth by device, peak-memory and
bandwidth-fraction records in ``benchmark.extra_info``."""

from __future__ import annotations

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

CUDA = torch.cuda.is_available()
PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, by a substring of the device name


def peak_bandwidth() -> float | None:
    """Spec HBM bandwidth of GPU 0 (None off CUDA or for an unlisted device)."""
    if not CUDA:
        return None
    name = torch.cuda.get_device_name(0)
    return next((bw for key, bw in PEAK_HBM.items() if key in name), None)


def record_peak_memory(benchmark, run) -> None:
    """Run ``run`` once and record the extra GPU memory it allocated at peak (None on CPU)."""
    if CUDA:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated() - base
    else:
        benchmark.extra_info["peak_memory_bytes"] = None  # no allocator statistics on CPU


def cpu_peak_and_held(run) -> tuple[int, int]:
    """(peak, held at the end) CPU bytes above the start of ``run()``, its result kept alive
    to the end: the running sum of the allocation events torch's profiler records
    (``profile_memory=True``: every c10 CPU allocation and free, in time order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            sizes.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(sizes):
        current += size
        peak = max(peak, current)
    del result
    return peak, current


def record_bandwidth(benchmark, moved: int) -> None:
    """After the timing: compulsory bytes per second, and as a fraction of peak HBM on a GPU."""
    median = benchmark.stats.stats.median
    benchmark.extra_info["bytes_per_s"] = moved / median
    peak = peak_bandwidth()
    if peak is not None:
        benchmark.extra_info["hbm_fraction"] = moved / median / peak


# -- data-parallel benchmarks: one model, bytes each rank holds ---------------------------------
HIDDEN, LAYERS, BATCH, ITERS = 512, 4, 64, 8


def mlp_model(hidden: int = HIDDEN) -> torch.nn.Module:
    """The 4 x Linear(512, 512) + GELU chain every data-parallel benchmark trains (``hidden``:
    another width)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def nbytes(tensors) -> int:
    """Bytes of the (local shards of the) tensors; DTensors count their local part."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)


def state_bytes(opt) -> int:
    """Bytes of an optimizer's state (ZeroRedundancyOptimizer keeps its own in ``.optim``)."""
    inner = getattr(opt, "optim", opt)
    return nbytes(v for s in inner.state.values() for v in s.values() if torch.is_tensor(v))


def visible_bytes(model: torch.nn.Module, opt) -> int:
    """Parameters, their gradients and the optimizer state, as visible from Python."""
    params = list(model.parameters())
    return nbytes(params) + nbytes(p.grad for p in params) + state_bytes(opt)


def torch_pipeline_step(mesh, theirs, x: torch.Tensor):
    """One step of a torch.distributed.pipelining schedule on this rank: the first stage feeds
    ``x``, the last takes it as the target."""

    def step() -> None:
        if mesh.is_first_stage:
            theirs.step(x)
        elif mesh.is_last_stage:
            theirs.step(target=x)
        else:
            theirs.step()

    return step


def median_step_times(runs: dict, iters: int) -> dict[str, float]:
    """Median seconds of each of ``runs`` (name -> a step callable) on the same ranks, the steps
    alternating, each between barriers; the first round is a warm-up."""
    import statistics
    import time

    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in runs}
    for it in range(iters + 1):
        for name, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run()
            dist.barrier()
            if it:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def pipelines_side_by_side(mesh, ours, theirs, x: torch.Tensor, iters: int) -> dict[str, float]:
    """Median step times of a fastpar ``PipelineEngine`` (``ours``) and a
    torch.distributed.pipelining schedule (``theirs``) on the same ranks, alternating steps,
    each between barriers; the first step of each is a warm-up. ``x`` is the input and the
    target (an MSE loss)."""
    runs = {
        "fastpar": lambda: ours.train_step(x, x, broadcast_loss=False),
        "torch": torch_pipeline_step(mesh, theirs, x),
    }
    return median_step_times(runs, iters)
