"""The docs work as written: every python block of docs/*.md marked ``<!-- run: N ranks -->``
runs (its ``main(path)`` on N CPU ranks over gloo, ``path`` a fresh directory), every
``--flag`` the pages and the README give ``python -m fastpar.train`` is a flag of the training
command, every relative link of the README and the docs resolves, and the README stays a short
page that links every docs page."""

from __future__ import annotations

import pathlib
import re

import pytest

from fastpar.testing import run_ranks

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
RUN = re.compile(r"<!-- run: (\d+) ranks? -->\s*```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in sorted(DOCS.glob("*.md")):
        for i, m in enumerate(RUN.finditer(page.read_text())):
            out.append((f"{page.name}#{i}", int(m.group(1)), m.group(2)))
    return out


def _run_block(source: str, path: str):
    scope: dict = {"__name__": "docs_example"}
    exec(compile(source, "<docs>", "exec"), scope)  # our own docs
    return scope["main"](path)


def test_the_docs_have_runnable_examples():
    assert _blocks(), "no docs page carries a runnable example"


@pytest.mark.parametrize("name,ranks,source", _blocks(), ids=[b[0] for b in _blocks()])
def test_docs_example_runs(name, ranks, source, tmp_path):
    out = run_ranks(_run_block, ranks, source, str(tmp_path / "ckpt"))
    assert out == list(range(ranks)), f"{name}: main() should return each rank's number"


def test_every_trainer_flag_in_the_docs_exists():
    from fastpar.train.cli import build_parser

    known = {s for a in build_parser()._actions for s in a.option_strings}
    pages = [*DOCS.glob("*.md"), DOCS.parent / "README.md"]
    missing = []
    for page in pages:
        for line in page.read_text().splitlines():
            if "fastpar.train" not in line:
                continue
            after = line.split("fastpar.train", 1)[1]  # torchrun's own flags come before
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", after):
                if flag not in known:
                    missing.append(f"{page.name}: {flag}")
    assert not missing, missing


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_resolves():
    broken = []
    for page in [*DOCS.glob("*.md"), DOCS.parent / "README.md"]:
        for target in LINK.findall(page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken


def test_the_readme_is_short_and_links_every_docs_page():
    text = (DOCS.parent / "README.md").read_text()
    assert len(text.split()) <= 1600, "the README is one page: move details to docs/"
    unlinked = [p.name for p in DOCS.glob("*.md") if f"docs/{p.name}" not in text]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


#: a path of the repository in backticks: under one of its folders (what a run writes under
#: bench/results/ left out), or a bare Python file's name
REPO_PATH = re.compile(
    r"^(?:(?:fastpar|tests|scripts|docs|\.ci)/[\w./*-]*|bench/(?!results/)[\w./*-]*|[\w-]+\.py)$"
)
FOLDERS = ("fastpar", "tests", "scripts", "bench", "docs", ".ci")
#: a module or attribute of fastpar in backticks (``fastpar.nn.check.distinct_blocks``)
DOTTED = re.compile(r"^fastpar(?:\.[A-Za-z_]\w*)+$")


def _resolves(dotted: str) -> bool:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_path_and_module_named_in_the_docs_exists():
    """A path (`fastpar/nn/check.py`, `tests/test_docs.py`, `checks.py`) or a module or attribute
    (`fastpar.checkpoint.gather_grads`) named in backticks outside code blocks: drift is a
    failure (a renamed file, a removed function)."""
    root, missing = DOCS.parent, []
    for page in [*DOCS.glob("*.md"), root / "README.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", text):
            name = re.sub(r"(?:\(\))?(?:::.*|:\d+(?:-\d+)?)?$", "", span.strip())
            if REPO_PATH.match(name):
                if "/" not in name:  # a bare file name: somewhere in the repository's folders
                    ok = (root / name).exists() or any(
                        any((root / d).glob(f"**/{name}")) for d in FOLDERS
                    )
                else:
                    ok = any(root.glob(name)) if "*" in name else (root / name).exists()
            elif DOTTED.match(name):
                ok = _resolves(name)
            else:
                continue
            if not ok:
                missing.append(f"{page.name}: {span}")
    assert not missing, missing
