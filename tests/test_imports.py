"""The import graph of fastpar: its units in layers, no upward import, no cycle.

Every module under ``fastpar/`` is parsed (``ast``: nothing is imported, no side effect) and each
import of a fastpar module, at module level or inside a function, becomes an edge between two
units: a subpackage (``amp`` for everything under ``fastpar/amp/``; each subpackage of
``parallel`` is one, ``parallel.data`` for ``fastpar/parallel/data/``), a top-level module
(``verify`` for ``fastpar/verify.py``) or the package root (``fastpar``: ``fastpar/__init__.py``,
reached by ``import fastpar`` or ``from fastpar import <a name that is no submodule>``). The
parent packages Python runs on the way (``fastpar/__init__.py`` before every ``fastpar.x``) are
not edges. A ``__main__`` module is an entry point (``python -m fastpar.mesh``): it may import
any unit, and no module may import it.

``LAYERS`` is the one place that orders the units, bottom first. A unit imports only units of
lower layers: never its own layer's other units, never a higher layer (``KNOWN`` lists the
edges still against it, each with its fix). Function-level imports of fastpar modules in the
library (every layer up to ``models``) are refused too: there they only hide an edge. Optional dependencies (transformers, safetensors, tokenizers, triton, numpy,
and fastpar's own optional parts, the C++ extension ``fastpar._C`` and the Triton kernels
``fastpar.kernels``) are imported inside functions by design and are not fastpar edges.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "fastpar"

LAYERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("switches",), "the FASTPAR_* environment switches and their API"),
    (
        (
            "version",
            "profiling",
            "debug",
            "reference",
            "data",
            "tolerance",
            "cliutil",
            "families",
            "kernels",
        ),
        "leaves: torch, numpy, the standard library and the switches (kernels: Triton)",
    ),
    (("flight",), "the flight recorder: torch's and fastpar's records, dumps, their analysis"),
    (("mesh",), "rank layout, ParallelMesh, placement (parameter marks, replica groups, ranks)"),
    (("launch",), "the rank launcher (processes, their errors and timeouts)"),
    (("comm",), "every collective: differentiable ones over a group, plain wraps the rest"),
    (("ops",), "autograd Functions; each picks Triton, the extension or the reference"),
    (("parallel.context",), "context parallelism: ring and all-to-all attention (comm, ops)"),
    (("amp",), "loss scalers, the global norm, the guarded step: ops and placement suffice"),
    (("optim",), "FusedAdamW, fp32 masters, the checkpoint-pieces protocol"),
    (
        ("parallel.data",),
        "data parallelism: one family over flat shards, buckets (amp, optim, placement, comm)",
    ),
    (("parallel",), "fastpar.parallel: re-exports parallel.data's wrappers and protocols"),
    (("parallel.pipeline",), "the pipeline: partition, schedules, engine (data's GradSync)"),
    (("moe",), "router and MoE layer (placement, comm and ops)"),
    (("nn",), "tensor-parallel layers and parallelize; re-exports MoE as fastpar.nn.MoE"),
    (("fastpar",), "the package root: re-exports mesh and nn.parallelize"),
    (("zero",), "ZeRO-1/2/3 on amp's guarded step and parallel.data's family"),
    (("checkpoint",), "save / load / reshard / HF; reads marks, optimizer protocols"),
    (("models",), "GPT and Llama from fastpar layers, HF model builders"),
    (("parity",), "check_parallel: a layout against the single-process model"),
    (("testing",), "the multi-rank harness (re-exports check_parallel)"),
    (("train",), "the training command"),
    (("verify", "export", "info", "tokenizer"), "command-line entry points"),
)
"""Bottom first: (units, what the layer is)."""

_MODELS = next(i for i, (units, _) in enumerate(LAYERS) if "models" in units)
LIBRARY = tuple(u for units, _ in LAYERS[: _MODELS + 1] for u in units)
"""Units up to ``models``, whose fastpar imports must all be at module level (above them the
harness, the trainer and the command-line tools may import lazily, downward, to start fast)."""

OPTIONAL = ("fastpar._C", "fastpar.kernels")
"""fastpar's optional parts: built or provided outside fastpar/, probed lazily."""

KNOWN: dict[tuple[str, str], str] = {}
"""Edges against the layers still present, each with its fix; the test fails once one is gone
(delete it here) and on any other."""


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    path: str  # its file, relative to the package's parent
    line: int
    target: str  # the imported fastpar module, dotted (the root for a name of the root)
    in_function: bool
    typing: bool = False  # under ``if TYPE_CHECKING:``: never run, so it closes no cycle

    def where(self) -> str:
        return f"{self.path}:{self.line}{' (in a function)' if self.in_function else ''}"


def _places(imports: list[Import], most: int) -> str:
    """Where ``imports`` are, each statement once, at most ``most`` of them."""
    places = list(dict.fromkeys(i.where() for i in imports))
    return ", ".join(places[:most]) + (" ..." if len(places) > most else "")


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.AST, module: str, is_package: bool, known) -> list[str]:
    """Dotted modules an import statement (or ``importlib.import_module("...")``) names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
            base = ".".join(parts + ([node.module] if node.module else []))
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def scan(
    root: pathlib.Path, optional: tuple[str, ...] = OPTIONAL
) -> tuple[list[Import], list[str]]:
    """Every import of one of the package's own modules (its ``optional`` parts left out), and
    the imports of package names that exist nowhere under ``root``."""
    name = root.name
    known = modules(root)
    found, missing = [], []
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(root.parent))
        stack: list[tuple[ast.AST, bool, bool]] = [(tree, False, False)]
        while stack:
            node, in_function, typing = stack.pop()
            inner = in_function or isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            hint = typing or (
                isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            )
            stack += [(child, inner, hint) for child in ast.iter_child_nodes(node)]
            for target in _targets(node, module, path.name == "__init__.py", known):
                if target != name and not target.startswith(name + "."):
                    continue
                if any(target == o or target.startswith(o + ".") for o in optional):
                    continue
                if target not in known:
                    missing.append(f"{rel}:{node.lineno} imports {target}, which does not exist")
                    continue
                found.append(Import(module, rel, node.lineno, target, in_function, typing))
    return sorted(found, key=lambda i: (i.path, i.line, i.target)), missing


SPLIT = ("parallel",)
"""Subpackages whose own subpackages are units (``parallel.data`` for everything under
``fastpar/parallel/data/``); the subpackage's ``__init__`` is a unit of its own (``parallel``)."""


def unit(module: str) -> str:
    """The unit of a dotted module: its top-level subpackage or module (a subpackage of one of
    ``SPLIT``), ``fastpar`` for the root, the module itself for a ``__main__``."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return ".".join(parts[1:])
    if len(parts) > 2 and parts[1] in SPLIT:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else parts[0]


def edges(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """(importing unit, imported unit) -> the imports behind that edge."""
    out: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        a, b = unit(imp.module), unit(imp.target)
        if a != b:
            out.setdefault((a, b), []).append(imp)
    return out


def layer_of(layers) -> dict[str, int]:
    return {u: i for i, (units, _) in enumerate(layers) for u in units}


def against_layers(graph, layers) -> dict[tuple[str, str], str]:
    """Edges that do not go strictly down, each with a message naming the imports."""
    rank, top = layer_of(layers), len(layers)
    bad = {}
    for (a, b), imps in sorted(graph.items()):
        shown = _places(imps, 3)
        if b.endswith("__main__"):
            bad[(a, b)] = f"{a} imports the entry point {b}: {shown}"
        elif a.endswith("__main__") or rank.get(a, top) > rank.get(b, top):
            continue
        else:
            how = "its own layer's" if rank.get(a) == rank.get(b) else "the higher"
            bad[(a, b)] = f"{a} imports {how} {b}: {shown}"
    return bad


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    succ: dict[str, list[str]] = {}
    for a, b in graph:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                out.append(sorted([v, *comp]))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(cycle: list[str], graph) -> str:
    """``a -> b -> a`` with the imports behind each edge inside the cycle."""
    inside = {(a, b): imps for (a, b), imps in graph.items() if a in cycle and b in cycle}
    shown = "; ".join(f"{a} -> {b} ({_places(imps, 2)})" for (a, b), imps in sorted(inside.items()))
    return f"cycle {' / '.join(cycle)}: {shown}"


def module_graph(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """Module -> module edges of the imports that run (not those under TYPE_CHECKING)."""
    out: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        if imp.module != imp.target and not imp.typing:
            out.setdefault((imp.module, imp.target), []).append(imp)
    return out


@pytest.fixture(scope="module")
def scanned():
    return scan(ROOT)


def test_every_import_names_a_module_of_fastpar(scanned):
    assert scanned[1] == []


def test_every_unit_has_one_layer(scanned):
    units = {unit(m) for m in modules(ROOT) if not m.endswith("__main__")}
    listed = [u for units_, _ in LAYERS for u in units_]
    assert sorted(u for u in set(listed) if listed.count(u) > 1) == [], "listed twice"
    assert sorted(units - set(listed)) == [], "in no layer of LAYERS: add them where they belong"
    assert sorted(set(listed) - units) == [], "listed in LAYERS but absent from fastpar/"
    assert set(LIBRARY) <= set(listed)


def test_no_unit_imports_upward_or_sideways(scanned):
    bad = against_layers(edges(scanned[0]), LAYERS)
    new = [msg for key, msg in bad.items() if key not in KNOWN]
    assert new == [], "\n".join(new)
    gone = sorted(set(KNOWN) - set(bad))
    assert gone == [], f"fixed, so remove from KNOWN: {gone}"


def test_no_cycle_between_units_or_modules(scanned):
    """Cycles only through the known edges (the layer check implies this, but names the loop)."""
    graph = edges(scanned[0])
    found = [describe(c, graph) for c in cycles({k: v for k, v in graph.items() if k not in KNOWN})]
    assert found == [], "\n".join(found)
    mods = {
        k: v for k, v in module_graph(scanned[0]).items() if (unit(k[0]), unit(k[1])) not in KNOWN
    }
    found = [describe(c, mods) for c in cycles(mods)]
    assert found == [], "\n".join(found)


def test_library_imports_fastpar_at_module_level(scanned):
    hidden = [
        f"{i.where()}: {i.module} imports {i.target}"
        for i in scanned[0]
        if i.in_function and unit(i.module) in LIBRARY
    ]
    assert hidden == [], "move these to the top of their module:\n" + "\n".join(hidden)


def _write(pkg, files: dict[str, str]) -> None:
    """A small package on disk: ``files`` maps paths under ``pkg`` to their text."""
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)


def test_the_checks_find_cycles_upward_and_hidden_imports(tmp_path):
    """A small package with each fault: the checks above must name every one of them."""
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "low/__init__.py": "from pkg.low.a import f\n",
        "low/a.py": "def f():\n    from pkg.high import g\n    import transformers\n",
        "high/__init__.py": "import pkg.low\nfrom pkg import low\nimport pkg._C\n",
        "high/__main__.py": "import pkg.high\n",
        "side.py": "import importlib\nM = importlib.import_module('pkg.side2')\n",
        "side2.py": "from pkg import nothing_here\nimport pkg.missing\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low.c import X\n",
        "low/c.py": "import pkg.low.b\nX = 1\n",
    }
    _write(pkg, files)
    imports, missing = scan(pkg, optional=("pkg._C",))
    assert missing == ["pkg/side2.py:2 imports pkg.missing, which does not exist"]
    graph = edges(imports)
    assert sorted(graph) == [
        ("high", "low"),
        ("high.__main__", "high"),
        ("low", "high"),
        ("side", "side2"),
        ("side2", "pkg"),
    ]
    assert [i.in_function for i in graph[("low", "high")]] == [True]
    layers = ((("pkg",), ""), (("low", "side", "side2"), ""), (("high",), ""))
    bad = against_layers(graph, layers)
    assert sorted(bad) == [("low", "high"), ("side", "side2")]
    assert bad[("low", "high")] == "low imports the higher high: pkg/low/a.py:2 (in a function)"
    assert bad[("side", "side2")].startswith("side imports its own layer's side2")
    assert cycles(graph) == [["high", "low"]]
    hints = [i for i in imports if i.typing]  # low.b -> low.c under TYPE_CHECKING: no cycle
    assert [(i.module, i.target) for i in hints] == [("pkg.low.b", "pkg.low.c")]
    assert cycles(module_graph(imports)) == [["pkg.high", "pkg.low", "pkg.low.a"]]  # not b/c
    assert "low -> high (pkg/low/a.py:2 (in a function))" in describe(["high", "low"], graph)
    assert against_layers({("low", "high.__main__"): graph[("low", "high")]}, layers) == {
        ("low", "high.__main__"): "low imports the entry point high.__main__: "
        "pkg/low/a.py:2 (in a function)"
    }


COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "all_gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "all_to_all",
        "all_to_all_single",
        "send",
        "recv",
        "isend",
        "irecv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "_all_gather_base",
        "_reduce_scatter_base",
    }
)
"""torch.distributed's collectives and point-to-point calls: fastpar runs them in fastpar/comm/
only (``fastpar.comm.plain`` wraps the non-differentiable ones)."""

DIRECT_ALLOWED: dict[tuple[str, str], str] = {
    # (file, function): why it calls torch.distributed itself; each unit sits below comm
    ("fastpar/mesh/check.py", "group_sums"): "mesh: proves each new group spans its ranks",
    (
        "fastpar/launch/pool.py",
        "_serve",
    ): "launch: a pool rank's start-up and between-call barriers",
    ("fastpar/launch/worker.py", "worker"): "launch: a rank's start-up and exit barriers",
}
"""The places outside fastpar/comm/ allowed to call a collective directly: group creation and
its check in mesh/, process start-up in launch/. The test fails on any other, and on an entry
no longer needed."""


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted module or object it stands for, from every import of ``tree``."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``dist.all_reduce`` -> ``torch.distributed.all_reduce`` (None for anything but a name
    or a chain of attributes)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def direct_collectives(root: pathlib.Path) -> list[tuple[str, str, int, str]]:
    """(file, enclosing function's qualified name or ``<module>``, line, callee) of every call
    of a torch.distributed collective outside ``root``/comm/."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        if path.relative_to(root).parts[0] == "comm":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = _aliases(tree)
        stack: list[tuple[ast.AST, str]] = [(tree, "<module>")]
        while stack:
            node, where = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                where = node.name if where == "<module>" else f"{where}.{node.name}"
            stack += [(child, where) for child in ast.iter_child_nodes(node)]
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func, aliases) or ""
            if name.startswith("torch.distributed.") and name.split(".")[-1] in COLLECTIVES:
                found.append((rel, where, node.lineno, name))
    return sorted(found)


def test_collectives_run_in_comm_only():
    """Every torch.distributed collective of fastpar is called in fastpar/comm/ (a function of
    ``fastpar.comm``, e.g. ``fastpar.comm.plain``), but in the places of ``DIRECT_ALLOWED``."""
    found = direct_collectives(ROOT)
    bad = [
        f"{f}:{line} ({where}) calls {name}"
        for f, where, line, name in found
        if (f, where) not in DIRECT_ALLOWED
    ]
    assert bad == [], "call these through fastpar/comm/ (fastpar.comm.plain):\n" + "\n".join(bad)
    unused = sorted(set(DIRECT_ALLOWED) - {(f, where) for f, where, *_ in found})
    assert unused == [], (
        f"no direct collective there any more, so remove from DIRECT_ALLOWED: {unused}"
    )


def test_the_collective_check_sees_every_spelling(tmp_path):
    """A small package calling collectives by an alias, by ``torch.distributed.`` and by an
    imported name, in a function, a method and at module level: each is found, where it is;
    comm/'s own calls, other torch.distributed calls and mere references are not."""
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "comm/__init__.py": "import torch.distributed as dist\ndist.all_reduce(x)\n",
        "a.py": "import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t)\n    dist.get_rank()\n",
        "b.py": "import torch\nclass C:\n    def g(self):\n        torch.distributed.barrier()\n",
        "c.py": "from torch.distributed import broadcast as b\nb(t, src=0)\n",
        "d.py": "from torch import distributed\ndef h():\n    return distributed.isend\n",
    }
    _write(pkg, files)
    assert direct_collectives(pkg) == [
        ("pkg/a.py", "f", 3, "torch.distributed.all_reduce"),
        ("pkg/b.py", "C.g", 4, "torch.distributed.barrier"),
        ("pkg/c.py", "<module>", 2, "torch.distributed.broadcast"),
    ]


MAX_LINES = 500
"""docs/contributing.md's rule: every module under 500 lines (after ruff format)."""


def long_modules(root: pathlib.Path) -> list[str]:
    """The modules under ``root`` of ``MAX_LINES`` lines or more, with their line counts."""
    found = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n >= MAX_LINES:
            found.append(f"{path.relative_to(root.parent)}: {n} lines")
    return found


def test_every_module_under_500_lines(tmp_path):
    """No module of fastpar reaches 500 lines (split one by concept); the check sees one."""
    assert long_modules(ROOT) == [], "split these by concept (docs/contributing.md, Style)"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "small.py").write_text("x = 1\n" * 499)
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * 500)
    assert long_modules(tmp_path / "pkg") == ["pkg/big.py: 500 lines"]


def untyped_meshes(root: pathlib.Path) -> list[str]:
    """The functions under ``root`` with a ``mesh`` or ``device_mesh`` parameter that has no
    type annotation."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if arg.arg in ("mesh", "device_mesh") and arg.annotation is None:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}")
    return found


def test_every_mesh_parameter_is_typed(tmp_path):
    """Issue 46's "one typed mesh": every ``mesh`` / ``device_mesh`` parameter of fastpar says
    what it takes (a ParallelMesh, a DeviceMesh, or either where the bridge converts it); the
    check sees an untyped one."""
    assert untyped_meshes(ROOT) == [], "annotate these (ParallelMesh | DeviceMesh | None, ...)"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def ok(mesh: int = None): ...\ndef bad(x, *, mesh=None): ...\n"
    )
    assert untyped_meshes(tmp_path / "pkg") == ["pkg/m.py:2 bad"]
