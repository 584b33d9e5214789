"""Fixtures of the pipeline tests: the repository root, ci/pipeline.py, docker/images.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def pipeline():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from ci import pipeline

    return pipeline


@pytest.fixture(scope="session")
def images():
    return load("docker/images.py", "qsa_images")
