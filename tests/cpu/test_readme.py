"""The README's usage example runs as written (the front door must not rot)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_usage_example_runs(capsys):
    text = README.read_text(encoding="utf-8")
    match = re.search(r"## Use\n\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its '## Use' python example"
    exec(compile(match.group(1), "README.md:Use", "exec"), {})
    printed = capsys.readouterr().out
    assert "CPU tensors:" in printed and "CUDA tensors:" in printed


def test_ci_runs_the_readme_test_command():
    text = README.read_text(encoding="utf-8")
    match = re.search(r"# the tests\n(.+)\n", text)
    assert match, "README.md lost its test command"
    command = match.group(1).strip()
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert command in ci, f".ci/run does not run the README's test command {command!r}"
