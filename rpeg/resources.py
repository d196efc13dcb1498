"""Files rpeg ships: the grammar, the example pipelines, the clusters and their profiles.

    >>> shipped("grammar", "rpeg.lark").name
    'rpeg.lark'
    >>> shipped("pipelines", "clusters", "local_cpu.rpeg").exists()
    True

They are package data under ``rpeg/_data``, found through ``importlib.resources`` so that
an installed wheel reads its own copy; in the source tree ``rpeg/_data/grammar`` and
``rpeg/_data/pipelines`` are links to the top-level ``grammar/`` and ``pipelines/``
folders, which stay where the project's layout puts them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_root() -> Path:
    """The folder that holds the shipped files (a real folder: wheels install unzipped)."""
    return Path(str(resources.files("rpeg") / "_data"))


def shipped(*parts: str) -> Path:
    """The path of one shipped file or folder, e.g. ``shipped("pipelines", "clusters")``."""
    return data_root().joinpath(*parts)


def grammar_path() -> Path:
    return shipped("grammar", "rpeg.lark")


def clusters_dir() -> Path:
    return shipped("pipelines", "clusters")


def profiles_dir() -> Path:
    return shipped("pipelines", "clusters", "profiles")
