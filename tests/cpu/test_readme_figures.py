"""The README's measured figures are the records' (rendered from them by ci/readme_figures.py),
no figure of those records appears twice with different values, and the torch requirement the
wheel declares is the one the README states and the library targets."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


figures = _load("ci/readme_figures.py", "qsa_readme_figures")
build_targets = _load("build_targets.py", "qsa_build_targets")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readmes_figure_blocks_are_the_records():
    records = figures.load_records()
    blocks = [m["name"] for m in figures.BLOCK.finditer(README)]
    assert set(blocks) == set(figures.BLOCKS), blocks
    assert figures.render(README, records) == README, (
        "README figure blocks differ from results/gpu-validation.json: "
        "run python3 ci/readme_figures.py"
    )


def test_the_validation_claim_names_the_records_artifacts():
    record = figures.load_records()["validation"]
    block = next(
        m["body"] for m in figures.BLOCK.finditer(README) if m["name"] == "validated-wheel"
    )
    assert record["wheel"]["name"] in block and record["wheel"]["sha256"][:8] in block
    assert record["dso"]["sha256"][:8] in block
    assert record["built_from"]["git"]["commit"][:7] in block
    assert f"{record['tests']['passed']} GPU tests passed" in block


def test_host_cost_ratios_appear_once():
    """The host-cost ratios are stated in one place: nowhere else does the README give an
    attention or selection ratio to `add_`."""
    outside = figures.BLOCK.sub("", README)
    assert not re.search(r"(attention|selection)\s+\d\.\d+x a plain `add_`", outside)
    record = figures.load_records()["validation"]["timing"]["host_overhead"]
    for key in ("attention_ratio", "select_ratio"):
        assert README.count(f"({record[key]:.2f}x)") == 1


def test_every_ratio_of_the_benchmark_section_is_the_records():
    """A figure ``N.NNx`` in the Benchmark section outside the rendered blocks must be one the
    record gives (upstream / kernel of a case), so that prose cannot drift from the table."""
    records = figures.load_records()
    ratios = [figures.upstream_of(records, c)[1] for c in records["validation"]["timing"]["cases"]]
    known = {f"{r:.2f}" for r in ratios if r is not None}  # None: no upstream (float16 attention)
    section = README.split("## Benchmark", 1)[1].split("\n## ", 1)[0]
    prose = figures.BLOCK.sub("", section)
    found = {n for pair in re.findall(r"(\d+\.\d\d)(?:-(\d+\.\d\d))?x", prose) for n in pair if n}
    assert found and found <= known, sorted(found - known)


def test_the_declared_torch_requirement_is_the_librarys_target():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in deps if re.match(r"torch\b", d)]
    target = build_targets.TORCH_TARGET_VERSION
    version = f"{target >> 56}.{(target >> 48) & 0xFF}"
    assert torch == f"torch>={version}"
    claims = re.findall(r"torch >= (\d+\.\d+)", README)
    assert claims and set(claims) == {version}
    assert "numpy" in deps  # torch warns at import without it
