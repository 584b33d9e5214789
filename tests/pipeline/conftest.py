"""Fixtures of the pipeline tests: the repository root and the noxfile loaded as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def noxfile():
    pytest.importorskip("nox", reason="the noxfile needs nox (the tests session installs it)")
    return load("noxfile.py", "qsa_noxfile")


@pytest.fixture(scope="session")
def images():
    return load("docker/images.py", "qsa_images")
