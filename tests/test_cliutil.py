"""``fastpar.cliutil.read_table``: the one reader of a command line's .toml / .json file (a
table, or one line naming the flag, the file and the fix)."""

from __future__ import annotations

import pytest

from fastpar.cliutil import read_table


@pytest.mark.parametrize(
    "name, text",
    [
        ("run.toml", 'steps = 7\nname = "a"\n[layout]\ntp = 2\n'),
        ("run.json", '{"steps": 7, "name": "a", "layout": {"tp": 2}}'),
    ],
)
def test_reads_the_table(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert read_table(str(path), "--config") == {"steps": 7, "name": "a", "layout": {"tp": 2}}


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.yaml", "steps: 1\n", "--config {path}: name a .toml or a .json file"),
        ("a.toml", "steps = \n", "--config {path}: cannot read it as TOML (not valid TOML: "),
        ("a.json", "{", "--config {path}: cannot read it as JSON (not valid JSON: "),
        ("a.json", "[1, 2]", "--config {path}: the file must hold a table of flags, not a list"),
        ("a.json", "7", "--config {path}: the file must hold a table of flags, not an int"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_table(str(path), "--config", holds="flags")
    text = str(info.value)
    assert text.startswith(message.format(path=path)) and "\n" not in text, text


def test_a_missing_file_names_the_reason(tmp_path):
    path = tmp_path / "none.toml"
    with pytest.raises(ValueError) as info:
        read_table(str(path), "--plan")
    text = str(info.value)
    assert text == f"--plan {path}: cannot read it as TOML (No such file or directory)", text
