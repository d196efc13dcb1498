"""The worked examples at the top of each rpeg.cost module run."""

from __future__ import annotations

import doctest
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODULES = ["compute", "memory", "stages", "topology", "profiles", "examples", "calibrate", "partial",
           "engines", "generation", "passes", "engine_sync",
           "__init__"]


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    mod = importlib.import_module("rpeg.cost" if name == "__init__" else f"rpeg.cost.{name}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} example(s) failed in {mod.__name__}"
    assert os.getcwd() == str(ROOT)
