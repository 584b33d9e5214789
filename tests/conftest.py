"""Shared test configuration: the ``gpu`` marker and the hypothesis profiles.

Hypothesis profiles (env ``HYPOTHESIS_PROFILE``): ``ci`` (default; the property tests run
about 1,100 examples in total), ``dev`` (a tenth of that) and ``thorough`` (ten times).
Property tests scale their budget from ``settings.default.max_examples``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", max_examples=100, **_COMMON)
settings.register_profile("dev", max_examples=10, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

GPU_SKIP_REASON = "no CUDA device: GPU tests run on the GPU runner"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
