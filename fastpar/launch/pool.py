"""A pool of live ranks for ``run_ranks``: start-up paid once per world size, not once a call
(``use_pool(True)``). What a call gets, what is put back between calls, and when ``run_ranks``
forks instead: docs/development.md ("The pool of live ranks").
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fastpar import families, flight
from fastpar.flight.record import reset as reset_flight
from fastpar.flight.record import settle, torch_buffer
from fastpar.launch.procs import kill
from fastpar.launch.worker import bind_to_parent, default_signals, error_report
from fastpar.switches import _SWITCHES

#: the pool's default-group timeout (s) while it starts; each call sets the call's own
POOL_GROUP_TIMEOUT_S = 1800.0

_enabled = False
_guard: Callable[[], str | None] | None = None
_pools: dict[int, Pool] = {}
_stats = {"pooled": 0, "forked": 0, "started": 0}


def use_pool(on: bool) -> None:
    """Turn the pool on or off for this process; off ends every live pool."""
    global _enabled
    _enabled = bool(on)
    if not on:
        for pool in list(_pools.values()):
            pool.close()
        _pools.clear()


def enabled() -> bool:
    return _enabled


def set_guard(guard: Callable[[], str | None] | None) -> None:
    """``guard()`` returns why the next call must fork (a reason) or None; the test harness
    installs one that says so when the running test has monkeypatched something."""
    global _guard
    _guard = guard


@contextlib.contextmanager
def forking(reason: str = "the caller patched what its ranks must see"):
    """Inside: every ``run_ranks`` call forks fresh ranks (they copy the caller as it is now,
    patches included); the live pools wait, untouched, for the calls after it."""
    _forcing.append(reason)
    try:
        yield
    finally:
        _forcing.remove(reason)


_forcing: list[str] = []


def stats() -> dict[str, int]:
    """Calls served by the pool, calls forked, pools started (this process)."""
    return dict(_stats)


def pack(fn: Callable, args: tuple, kwargs: dict) -> bytes | None:
    """The call as bytes for the pool, or None when it cannot travel (a local function or a
    lambda, an argument that does not pickle)."""
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception:
        return None


def why_fork(backend: str, start_method: str, threads_per_rank) -> str | None:
    if not _enabled:
        return "pool off"
    if start_method != "fork" or backend != "gloo":
        return "not a forked gloo run"
    if threads_per_rank not in (None, 1):
        return "more than one thread a rank"
    if _forcing:
        return _forcing[-1]
    if dist.is_available() and dist.is_initialized():
        return "the caller holds a process group"
    return _guard() if _guard is not None else None


def _fingerprint() -> tuple:
    """What of the caller the ranks copied at the fork and the pool cannot send: a change makes
    the pool start again."""
    return (
        tuple((k, id(v)) for k, v in families.REGISTRY.items()),
        torch.get_default_dtype(),
        tuple(sys.path),
    )


_PREIMPORTED = False


def preimport() -> None:
    """Import, once in the parent, what ranks would otherwise each import after the fork:
    building any torch optimizer imports torch._dynamo (seconds per rank on a small machine)."""
    global _PREIMPORTED
    if not _PREIMPORTED:
        _PREIMPORTED = True
        with contextlib.suppress(Exception):
            import torch._dynamo  # noqa: F401


def pool_for(world: int) -> Pool:
    pool = _pools.get(world)
    if pool is not None and not pool.usable():
        pool.close()
        pool = None
    if pool is None:
        pool = _pools[world] = Pool(world)
        _stats["started"] += 1
    return pool


class Pool:
    """``world`` live ranks (forked now) in one gloo group."""

    def __init__(self, world: int) -> None:
        preimport()
        self.world = world
        self.tmp = tempfile.mkdtemp(prefix=f"fastpar-pool{world}-")
        self.fingerprint = _fingerprint()
        self.procs: list[Any] = []
        self.tasks: list[Any] = []  # the caller's end: call bytes out
        self.results: list[Any] = []  # the caller's end: results in
        self.fds: list[socket.socket] = []  # the caller's stdout / stderr for each call
        ctx = mp.get_context("fork")
        store = os.path.join(self.tmp, "store")
        for rank in range(world):
            task_r, task_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            mine, theirs = socket.socketpair()
            p = ctx.Process(
                target=_serve,
                args=(rank, world, store, task_r, res_w, theirs, self.tmp, os.getpid()),
                name=f"fastpar-pool{world}-{rank}",
                daemon=True,
            )
            p.start()
            task_r.close()
            res_w.close()
            theirs.close()
            self.procs.append(p)
            self.tasks.append(task_w)
            self.results.append(res_r)
            self.fds.append(mine)

    def usable(self) -> bool:
        return all(p.is_alive() for p in self.procs) and self.fingerprint == _fingerprint()

    def stack_path(self, rank: int) -> str:
        return os.path.join(self.tmp, f"stack{rank}")

    def send(self, blob: bytes, flight_dir: str, collective_timeout: float) -> None:
        state = {
            "timeout": collective_timeout,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "rng": (torch.get_rng_state(), random.getstate(), _numpy_state()),
            "switches": {s.env: s._override for s in list(_SWITCHES) if s._override is not None},
            "flight_dir": flight_dir,
        }
        head = pickle.dumps(state)
        for sock, conn in zip(self.fds, self.tasks, strict=True):
            socket.send_fds(sock, [b"f"], [1, 2])
            conn.send_bytes(head)
            conn.send_bytes(blob)

    def close(self) -> None:
        kill(self.procs)
        for c in (*self.tasks, *self.results, *self.fds):
            with contextlib.suppress(Exception):
                c.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if _pools.get(self.world) is self:
            del _pools[self.world]


def _numpy_state():
    try:
        import numpy as np

        return np.random.get_state()
    except Exception:
        return None


def _apply_switches(overrides: dict[str, Any]) -> None:
    for s in list(_SWITCHES):
        s._override = overrides.get(s.env)
        s.refresh()


# -- the rank's side ------------------------------------------------------------------------
class _GroupCache:
    """``dist.new_group`` by (ranks, timeout, description, backend, how many such calls this task
    made before): the k-th identical request of a call gets the k-th group ever made for it, so a
    call gets as many distinct groups as it asks for, and the next call the same ones."""

    def __init__(self) -> None:
        self.made: dict[tuple, list] = {}
        self.used: dict[tuple, int] = {}
        self.real_new = dist.new_group
        self.real_destroy = dist.destroy_process_group
        self.broken = False

    def new_group(self, ranks=None, timeout=None, backend=None, pg_options=None, **kw):
        if pg_options is not None or set(kw) - {"group_desc", "use_local_synchronization"}:
            return self.real_new(ranks, timeout, backend, pg_options, **kw)
        key = (
            None if ranks is None else tuple(sorted(ranks)),
            timeout,
            backend,
            kw.get("group_desc"),
            bool(kw.get("use_local_synchronization", False)),
        )
        i = self.used.get(key, 0)
        self.used[key] = i + 1
        have = self.made.setdefault(key, [])
        if i < len(have):
            return have[i]
        group = self.real_new(ranks, timeout, backend, **kw)
        have.append(group)
        return group

    def destroy(self, group=None):
        if group is None or any(group is g for gs in self.made.values() for g in gs):
            self.broken = True  # the pool retires after this call
        return self.real_destroy(group)

    def install(self) -> None:
        dist.new_group = self.new_group
        dist.distributed_c10d.new_group = self.new_group
        dist.destroy_process_group = self.destroy
        dist.distributed_c10d.destroy_process_group = self.destroy


#: modules whose attributes a call may patch "in this rank only" (as a fork allowed): put back
_PATCHABLE = ("fastpar", "safetensors", "torch.distributed")


def _patchable(name: str, mod: Any) -> bool:
    if name.startswith(_PATCHABLE):
        return True
    path = getattr(mod, "__file__", None) or ""  # a test suite's own modules
    return f"{os.sep}tests{os.sep}" in path and name != "__main__"


def _put_back(saved: dict[str, tuple[Any, dict]]) -> None:
    """What a call rebound on a saved module gets its value back: any attribute of a test
    module, and a library's functions, classes and modules (its data is left, even where a
    lazy cache now holds a function: counters such as torch's group count and lazy caches must
    keep their new values)."""
    for name, (mod, attrs) in saved.items():
        now = vars(mod)
        everything = not name.startswith(_PATCHABLE)
        for k, v in attrs.items():
            new = now.get(k, _MISSING)
            if new is not v and (everything or callable(v) or inspect.ismodule(v)):
                with contextlib.suppress(Exception):
                    setattr(mod, k, v)


_MISSING = object()


def _base_state() -> dict:
    return {
        "modules": {
            name: (mod, dict(vars(mod)))
            for name, mod in list(sys.modules.items())
            if mod is not None and _patchable(name, mod)
        },
        "cwd": os.getcwd(),
        "signals": {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)},
        "dtype": torch.get_default_dtype(),
        "families": dict(families.REGISTRY),
        "threads": torch.get_num_threads(),
    }


def _restore(base: dict, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    with contextlib.suppress(OSError):
        os.chdir(base["cwd"])
    for s, h in base["signals"].items():
        with contextlib.suppress(Exception):
            signal.signal(s, h)
    torch.set_default_dtype(base["dtype"])
    torch.set_grad_enabled(True)
    if torch.get_num_threads() != base["threads"]:
        torch.set_num_threads(base["threads"])
    families.REGISTRY.clear()
    families.REGISTRY.update(base["families"])
    _put_back(base["modules"])
    _apply_switches({})


def _serve(rank, world, store_path, tasks, results, fd_sock, tmp, parent_pid) -> None:
    code = 0
    try:
        bind_to_parent(parent_pid, f"fastpar-rank{rank}")
        default_signals()
        # the caller's sys.stdout may be a test's capture: write to the fds each call sends
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        stack = open(os.path.join(tmp, f"stack{rank}"), "w")  # noqa: SIM115
        flight.arm(os.path.join(tmp, "flight"), rank)
        faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True, chain=True)
        ids = dict(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
        )
        os.environ.update(ids)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        torch_buffer()
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_path, world),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=POOL_GROUP_TIMEOUT_S),
        )
        if world > 1:
            dist.barrier()
        groups = _GroupCache()
        groups.install()
        base_env = dict(os.environ)
        base = _base_state()
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(fd_sock, 1, 2)
                head = tasks.recv_bytes()
                blob = tasks.recv_bytes()
            except (EOFError, OSError):
                break  # the caller closed the pool
            for target, fd in zip((1, 2), fds, strict=True):
                os.dup2(fd, target)
                os.close(fd)
            stack.seek(0)
            stack.truncate()
            status, payload = _run(head, blob, ids, groups)
            sys.stdout.flush()
            sys.stderr.flush()
            groups.used.clear()
            broken = groups.broken or not dist.is_initialized()
            _restore(base, base_env)
            try:
                out = pickle.dumps((status, rank, payload, broken))
            except Exception as exc:  # a result that does not pickle: the call's error
                status = "error"
                text = f"the result does not pickle: {type(exc).__name__}: {exc}"
                out = pickle.dumps((status, rank, ("PicklingError", text, "", None)))
            results.send_bytes(out)
            if status != "ok" or broken:
                code = 1
                break
            if world > 1:  # every rank done before the next call's first collective
                dist.barrier()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        settle()
        os._exit(code)


def _run(head: bytes, blob: bytes, ids: dict, groups: _GroupCache) -> tuple[str, Any]:
    state = pickle.loads(head)
    flight_dir = state["flight_dir"]
    try:
        os.environ.clear()
        os.environ.update({**state["env"], **ids})
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        with contextlib.suppress(OSError):
            os.chdir(state["cwd"])
        trng, prng, nrng = state["rng"]
        torch.set_rng_state(trng)
        random.setstate(prng)
        if nrng is not None:
            import numpy as np

            np.random.set_state(nrng)
        _apply_switches(state["switches"])
        # the default group's collectives wait what a fork's would (the mesh's groups take it)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=state["timeout"]))
        reset_flight()
        flight.arm(flight_dir, int(ids["RANK"]))
        fn, args, kwargs = pickle.loads(blob)
        return "ok", fn(*args, **kwargs)
    except BaseException as exc:
        return "error", error_report(exc, flight_dir)
