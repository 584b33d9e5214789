"""Fixtures of the pipeline tests: the repository root on the import path (the ci package),
ci/pipeline.py, docker/images.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the ci package, as `python3 -m ci.pipeline` sees it
    sys.path.insert(0, str(ROOT))


def load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def pipeline():
    from ci import pipeline

    return pipeline


@pytest.fixture(scope="session")
def images():
    return load("docker/images.py", "qsa_images")


@pytest.fixture(scope="session")
def nox_sessions():
    """noxfile.py's sessions, name -> function (the noxfile loaded once)."""
    pytest.importorskip("nox", reason="the noxfile needs nox (the tests session installs it)")
    import nox.registry

    load("noxfile.py", "qsa_noxfile")
    return dict(nox.registry.get())
