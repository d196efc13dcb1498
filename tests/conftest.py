"""Shared fixtures: paths into the repository."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def pipelines() -> Path:
    return ROOT / "pipelines"
