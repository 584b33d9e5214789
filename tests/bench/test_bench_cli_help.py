"""The bench's --help prints its text as written (argparse does not %-format a
description, so a doubled percent sign would show as typed)."""

from __future__ import annotations

import pytest

from custom_esimd_kernels_vllm.bench import cli


def test_help_text(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.parse_args(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "% of the memory floor" in text
    assert "%%" not in text
