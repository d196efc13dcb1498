"""Shared fixtures: paths into the repository.

The embedded default's profile is the shipped one in every test (and in every process a
test starts): a test's outcome never depends on a calibration of the machine it runs on,
or on one being cached (tests/runtime/test_machine.py sets its own).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["RPEG_LOCAL_PROFILE"] = "shipped"


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def pipelines() -> Path:
    return ROOT / "pipelines"
