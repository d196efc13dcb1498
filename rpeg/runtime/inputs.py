"""What a run reads from outside its run directory, checked before the run starts.

    >>> check_inputs(pipeline)                              # doctest: +SKIP
    >>> check_inputs(recorded, resumed=True)                # a resume: the paths the run read

Every path a spec names was resolved when it was loaded (``rpeg.spec.paths``), and the
run records the pipeline with those absolute paths (``pipeline.json``): a new run and a
resume read the same files, wherever the command is started. The datasets (the
workload's and the eval block's) are read in full, their first rows against the data
contract (``rpeg.runtime.datacheck``), so a bad row stops the run before any worker
starts; a ``python("module:function")`` module and a model's weights folder must be
there. A resumed run whose file is gone says so: where the run read it, and that it moved.

``from_older_record`` reads a ``pipeline.json`` written before the paths were recorded
(a dataset as the text the spec had): its paths are resolved against the spec's folder,
which that run recorded in run.json (``spec_dir``), as it ran.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import attrs

from rpeg.errors import RuntimeFailure, Span
from rpeg.runtime.data import eval_rows, workload_rows
from rpeg.runtime.datacheck import check_data
from rpeg.spec.inputs import named_files
from rpeg.spec.model import Pipeline
from rpeg.spec.paths import FileRef


def check_inputs(pipeline: Pipeline, *, resumed: bool = False) -> None:
    """RuntimeFailure when a file the run reads is missing or unusable (a resume: naming
    the path the run recorded and saying it moved)."""
    if resumed:
        for what, path, span in recorded_paths(pipeline):
            if not os.path.exists(path):
                raise RuntimeFailure(
                    f"{what} '{path}' must be where the run read it, and it is not there now "
                    "(moved or removed since the run started)", span,
                    hint=f"put it back at {path}: a resumed run reads the files its run read "
                         "(pipeline.json records them)")
    for m in pipeline.models:
        if m.weights and not os.path.isdir(m.weights):
            raise RuntimeFailure(f"model '{m.name}' weights folder '{m.weights}' must exist to "
                                 "run, and it does not", _at(m.span),
                                 hint="a path in a spec is relative to the folder of the file "
                                      "that names it")
    for r in pipeline.rewards:
        if r.source and not os.path.isfile(r.source):
            raise RuntimeFailure(f"reward '{r.name}' module '{r.module}' ({r.source}) must "
                                 "exist to run, and it does not", _at(r.span))
    check_data(pipeline)                    # the first rows against the data contract
    workload_rows(pipeline)
    if pipeline.evaluation is not None:
        eval_rows(pipeline)


def fingerprints(pipeline: Pipeline) -> dict[str, str]:
    """Absolute path -> a fingerprint of its content, for each file a run reads (its
    datasets and reward modules) and each weights folder (:func:`_folder_print`: a frozen
    model and a LoRA model's base are built from it again at every resume, a trained
    model's tokenizer read from it): what run.json records at the start, so a resume can
    say that one changed since."""
    out = {}
    for _, path, _ in recorded_paths(pipeline):
        if os.path.isfile(path):
            out[path] = _fingerprint(Path(path))
        elif os.path.isdir(path):
            out[path] = _folder_print(Path(path))
    return out


def _folder_print(path: Path) -> str:
    """A weights folder's files by name, size and modification time, as hex: replacing or
    rewriting a file changes it, and nothing of gigabytes of weights is read."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def changed_since(recorded: dict[str, str], pipeline: Pipeline) -> list[str]:
    """The files of ``recorded`` (:func:`fingerprints` at the run's start) whose content is
    not what the run read."""
    now = fingerprints(pipeline)
    return [p for p, f in recorded.items() if p in now and now[p] != f]


FINGERPRINT_WHOLE = 256 << 20      # bytes: a larger file is fingerprinted by its ends


def _fingerprint(path: Path) -> str:
    """SHA-256 of the file (of its size, first and last 16 MB past FINGERPRINT_WHOLE:
    a large dataset is not read whole at every start), as hex."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if size <= FINGERPRINT_WHOLE:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            h.update(fh.read(16 << 20))
            fh.seek(size - (16 << 20))
            h.update(fh.read(16 << 20))
    return h.hexdigest()


def recorded_paths(pipeline: Pipeline) -> list[tuple[str, str, Span | None]]:
    """(what, absolute path, where the spec names it) of every file the run reads
    (:func:`rpeg.spec.inputs.named_files`)."""
    return named_files(pipeline)


def from_older_record(pipeline: Pipeline, spec_dir: str | None) -> Pipeline:
    """A pipeline recorded with its paths as written: resolved against ``spec_dir``."""
    folder = Path(spec_dir or os.getcwd())

    def ref(v, span: Span) -> FileRef:
        if isinstance(v, FileRef) or v is None:
            return v
        return FileRef(str(v), os.path.normpath(folder / Path(str(v)).expanduser()), span)

    w = pipeline.workload
    changes = {"workload": attrs.evolve(w, dataset=ref(w.dataset, w.span))}
    if pipeline.evaluation is not None:
        e = pipeline.evaluation
        changes["evaluation"] = attrs.evolve(e, dataset=ref(e.dataset, e.span))
    changes["rewards"] = tuple(attrs.evolve(r, folder=str(folder)) if r.module and not r.folder
                               else r for r in pipeline.rewards)
    return attrs.evolve(pipeline, **changes)


def _at(span: Span | None) -> Span | None:
    return span if span is not None and span.line else None
