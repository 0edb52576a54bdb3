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
