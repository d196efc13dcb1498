"""Step checkpoints in a run directory: written atomically, found and checked on resume.

    runs/tiny_ppo-.../checkpoints/
        step-000010/                      state after steps 0..9 (the cut at step 10)
            actor@0/ model.safetensors optimizer.safetensors meta.json    one per replica
            critic@1/ meta.json           a trained replica: its meta.json names its shards
            critic.dcp/ shard-*.safetensors   each rank's own pieces, written once
            carry.safetensors carry.json  outputs made before the cut and read after it
            state.json                    step, replica versions, pending trace events
            COMPLETE                      written last: the manifest (name, size, sha256)
        step-000020.partial-3f2a/         an interrupted write: ignored, removed on resume

    >>> ck = latest(Path("runs/x"))                  # doctest: +SKIP
    >>> ck.step, ck.state["versions"]                # doctest: +SKIP
    (10, {'actor@0': 10, 'actor@1': 9, 'critic@1': 10})

A checkpoint is written into a ``.partial-*`` folder, every file fsync'ed, the
folder renamed to its final name, and only then the ``COMPLETE`` manifest
written (temporary name, fsync, rename, fsync of the folder). A crash at any
point leaves either no ``step-N`` folder or one without ``COMPLETE``, which
:func:`latest` skips. The manifest's SHA-256 of a file a worker wrote is the
worker's own, taken as it wrote it (:func:`save_replicas`: every writer at once, from its
page cache); the driver reads none of those back, and hashes only the files it writes
itself. A folder whose files no longer match the manifest (truncated, flipped bytes) is
refused with the file and what is wrong: :func:`validate` hashes every file again.

Nothing read here is unpickled: tensors are safetensors, everything else JSON;
``carry.json`` may name only classes from an allow-list (``backends.api``,
``rpeg.``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import stat
import uuid
from pathlib import Path

import attrs

from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.graph.ids import ReplicaAt, ReplicaKey
from rpeg.runtime.core.choices import pruned

FORMAT = 1
MARKER = "COMPLETE"
STATE = "state.json"
MAX_JSON_BYTES = 256 << 20
_CARRY_CLASSES = ("backends.api:", "rpeg.")


@attrs.frozen
class Checkpoint:
    path: Path
    step: int
    state: dict

    def replica_dir(self, key: str) -> Path:
        return self.path / key


def folder(run_dir: Path) -> Path:
    """The run's checkpoints folder; RuntimeFailure when it is a symlink or not a folder
    (written through, checkpoints and pruning would land elsewhere)."""
    root = Path(run_dir) / "checkpoints"
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        return root
    if not stat.S_ISDIR(mode):
        raise RuntimeFailure(f"checkpoints folder '{root}' must be a folder in the run "
                             "directory, not a symlink or a file", Span(str(root), 0, 0),
                             hint="rpeg writes only plain folders into a run directory")
    return root


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def begin(run_dir: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint at ``step``."""
    tmp = folder(run_dir) / f"{step_name(step)}.partial-{uuid.uuid4().hex[:6]}"
    tmp.mkdir(parents=True)
    return tmp


def commit(run_dir: Path, tmp: Path, step: int, state: dict,
           hashed: dict[str, tuple[int, str]] | None = None) -> Checkpoint:
    """Finish a checkpoint written into ``tmp``: state, fsync, rename, then the marker.

    ``hashed``: (size, sha256) of the files the workers wrote, by path relative to ``tmp``,
    as each writer hashed them (:func:`save_replicas`); they are not read again here, only
    checked to be there with that size. The driver hashes the rest (its own small files:
    state, carry)."""
    _write_synced(tmp / STATE, json.dumps({"format": FORMAT, "step": step, **state},
                                          indent=1, sort_keys=True))
    manifest = {"format": FORMAT, "step": step, "files": _manifest(tmp, hashed or {})}
    for f in tmp.rglob("*"):
        _fsync(f)
    final = folder(run_dir) / step_name(step)
    if os.path.lexists(final):               # never overwritten: an earlier write of this step
        set_aside(final, "replaced")         # that never completed, kept under its own name
    os.replace(tmp, final)
    _fsync(final.parent)
    _write_synced(final / MARKER, json.dumps(manifest, indent=1, sort_keys=True))
    _fsync(final)
    return Checkpoint(final, step, json.loads((final / STATE).read_text()))


def latest(run_dir: Path, *, before: int | None = None,
           skipped: list[str] | None = None, check=None) -> Checkpoint | None:
    """The newest complete, intact checkpoint (at a step < ``before``), or None.

    Incomplete ones (no marker) are passed over silently; damaged ones (``check``, a
    function of a checkpoint raising RpegError, says what else is damage: the backend
    reading its tensors) are passed over and described in ``skipped``.
    """
    root = folder(run_dir)
    if not root.is_dir():
        return None
    steps = []
    for p in root.iterdir():
        if p.is_dir() and not p.is_symlink() and p.name.startswith("step-") \
                and "." not in p.name:
            try:
                steps.append((int(p.name[5:]), p))
            except ValueError:
                continue
    for step, p in sorted(steps, reverse=True):
        if before is not None and step >= before:
            continue
        if not (p / MARKER).exists():
            continue
        try:
            ck = validate(p)
            if check is not None:
                check(ck)
            return ck
        except RpegError as e:
            if skipped is not None:
                skipped.append(e.located)
    return None


def validate(path: Path) -> Checkpoint:
    """Check a checkpoint folder against its manifest; RuntimeFailure naming what is wrong."""
    path = Path(path)
    marker = path / MARKER
    manifest = _read_json(marker, "checkpoint manifest")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or not isinstance(files, dict):
        got = manifest.get("format") if isinstance(manifest, dict) else \
            f"a JSON {type(manifest).__name__}"
        raise RuntimeFailure(f"checkpoint manifest must be an object of format {FORMAT} "
                             f"listing its files, not {got!r}"[:300], Span(str(marker), 0, 0),
                             hint="this checkpoint was written by another rpeg version, or "
                                  "damaged")
    for name, entry in files.items():
        f = path / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise RuntimeFailure(f"checkpoint manifest names a path outside the checkpoint: "
                                 f"{name!r}", Span(str(marker), 0, 0))
        if not isinstance(entry, dict):
            raise RuntimeFailure(f"checkpoint manifest entry {name!r} must be an object with "
                                 f"size and sha256, not {entry!r}"[:300], Span(str(marker), 0, 0))
        try:
            st = os.lstat(f)
        except OSError:
            raise RuntimeFailure(f"checkpoint file '{f}' is missing", Span(str(f), 0, 0)
                                 ) from None
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeFailure(f"checkpoint file '{f}' must be a regular file, not a "
                                 "symlink, pipe or device", Span(str(f), 0, 0))
        if st.st_size != entry.get("size"):
            raise RuntimeFailure(f"checkpoint file '{f}' must be {entry.get('size')} bytes, "
                                 f"not {st.st_size} (truncated or overwritten)",
                                 Span(str(f), 0, 0))
        if _sha256(f) != entry.get("sha256"):
            raise RuntimeFailure(f"checkpoint file '{f}' does not match its checksum "
                                 "(corrupted)", Span(str(f), 0, 0))
        if f.suffix == ".safetensors":
            _check_safetensors(f)
    state = _read_json(path / STATE, "checkpoint state")
    _check_state(state, path)
    return Checkpoint(path, state["step"], state)


def _check_state(state: object, path: Path) -> None:
    """state.json as :func:`commit` writes it, for the step its folder is named after."""
    where = Span(str(path / STATE), 0, 0)
    if not isinstance(state, dict) or isinstance(state.get("step"), bool) \
            or not isinstance(state.get("step"), int):
        raise RuntimeFailure("checkpoint state must be a JSON object with a step", where)
    if path.name.startswith("step-") and path.name[5:].isdigit() \
            and int(path.name[5:]) != state["step"]:
        raise RuntimeFailure(f"checkpoint state must be for step {int(path.name[5:])}, as its "
                             f"folder says, not step {state['step']}", where)
    checks = (("replicas", dict), ("pending", list), ("carry", list), ("events", list))
    for key, typ in checks:
        if key in state and not isinstance(state[key], typ):
            raise RuntimeFailure(f"checkpoint state field '{key}' must be a JSON "
                                 f"{'object' if typ is dict else 'list'}", where)
    for key in ("events_bytes", "events_count", "metrics_rows", "run_steps", "num_devices"):
        v = state.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise RuntimeFailure(f"checkpoint state field '{key}' must be a count, not {v!r}",
                                 where)
    for k, v in state.get("replicas", {}).items():
        if ReplicaAt.parse(k) is None or isinstance(v, bool) or not isinstance(v, int):
            raise RuntimeFailure(f"checkpoint state field 'replicas' must map MODEL@DEVICE to "
                                 f"a version, not {k!r}: {v!r}"[:300], where)
    for e in state.get("pending", []) + state.get("events", []):
        if not isinstance(e, dict) or isinstance(e.get("step"), bool) \
                or not isinstance(e.get("step"), int) or not isinstance(e.get("id"), str):
            raise RuntimeFailure("checkpoint state must hold op events with an id and a step",
                                 where)


def _check_safetensors(path: Path) -> None:
    """A safetensors file's header: an 8-byte length, then that much JSON (no tensor is
    read); a file that is something else is refused naming it."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            ok = 2 <= n <= min(path.stat().st_size - 8, 100 << 20)
            header = json.loads(fh.read(n)) if ok else None
    except (OSError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise RuntimeFailure(f"checkpoint file '{path}' must be a safetensors file, and it is "
                             "not", Span(str(path), 0, 0))


def set_aside(path: Path, why: str) -> Path:
    """Rename checkpoint folder ``path`` to ``STEP.WHY-N`` (the first N free), which no
    resume reads and no pruning removes; the new name."""
    n = 1
    while os.path.lexists(path.with_name(f"{path.name}.{why}-{n}")):
        n += 1
    new = path.with_name(f"{path.name}.{why}-{n}")
    os.replace(path, new)
    return new


def prune(run_dir: Path, keep: int = 2) -> None:
    """Remove interrupted writes and all but the newest ``keep`` complete checkpoints."""
    root = folder(run_dir)
    if not root.is_dir():
        return
    for p in root.glob("step-*.partial-*"):
        shutil.rmtree(p, ignore_errors=True)
    done = {int(p.name[5:]): p for p in root.glob("step-*")
            if (p / MARKER).exists() and "." not in p.name and p.name[5:].isdigit()}
    for p in (done[s] for s in pruned(done, keep)):
        # Rename first (atomic), then delete: a kill in the middle of deleting must not
        # leave a folder that still carries its marker but has lost some of its files.
        doomed = p.with_name(f"{p.name}.partial-pruned-{os.getpid()}")
        try:
            p.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def holds_optimizer(replica: Path) -> bool:
    """Whether a replica's folder in a checkpoint holds a trained replica's state: its
    optimizer's file, or a sharded checkpoint's shards (``meta.json`` names their folder,
    ``backends.torch_backend.dcp``)."""
    if (replica / "optimizer.safetensors").exists():
        return True
    try:
        meta = json.loads((replica / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("sharded"), str)


# --- carried data: outputs made before a cut and read after it ----------------------------

def save_tree(tmp: Path, name: str, tree: dict) -> None:
    """Arrays into ``NAME.safetensors``, structure into ``NAME.json`` (no pickle)."""
    import numpy as np
    from safetensors.numpy import save_file

    arrays: dict[str, np.ndarray] = {}

    def enc(v):
        if isinstance(v, np.ndarray):
            key = f"a{len(arrays)}"
            arrays[key] = np.ascontiguousarray(v)
            return {"__array__": key}
        if isinstance(v, np.generic):
            return v.item()
        if attrs.has(type(v)):
            cls = f"{type(v).__module__}:{type(v).__qualname__}"
            return {"__attrs__": cls,
                    "fields": {f.name: enc(getattr(v, f.name)) for f in attrs.fields(type(v))}}
        if isinstance(v, tuple):
            return {"__tuple__": [enc(x) for x in v]}
        if isinstance(v, list):
            return [enc(x) for x in v]
        if isinstance(v, dict):
            return {"__dict__": {str(k): enc(x) for k, x in v.items()}}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise RuntimeFailure(f"cannot checkpoint a value of type {type(v).__name__}")

    doc = enc(tree)
    save_file(arrays, str(tmp / f"{name}.safetensors"))
    (tmp / f"{name}.json").write_text(json.dumps(doc))


def load_tree(path: Path, name: str) -> dict:
    from safetensors.numpy import load_file

    doc = _read_json(path / f"{name}.json", "checkpoint data")
    tensors = path / f"{name}.safetensors"
    _check_safetensors(tensors)
    try:
        arrays = load_file(str(tensors))
    except Exception as e:  # noqa: BLE001 — safetensors' own errors: a damaged file
        raise RuntimeFailure(f"checkpoint file '{tensors}' must be a safetensors file rpeg "
                             f"wrote, and it is not ({e})"[:300], Span(str(tensors), 0, 0)
                             ) from None
    where = Span(str(path / f"{name}.json"), 0, 0)

    def dec(v):
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "__array__" in v:
            if v["__array__"] not in arrays:
                raise RuntimeFailure(f"checkpoint data names an array {v['__array__']!r} its "
                                     "safetensors file does not hold"[:300], where)
            return arrays[v["__array__"]]
        if "__tuple__" in v and isinstance(v["__tuple__"], list):
            return tuple(dec(x) for x in v["__tuple__"])
        if "__dict__" in v and isinstance(v["__dict__"], dict):
            return {k: dec(x) for k, x in v["__dict__"].items()}
        if "__attrs__" in v and isinstance(v.get("fields"), dict):
            cls = _carry_class(v["__attrs__"], path / f"{name}.json")
            try:
                return cls(**{k: dec(x) for k, x in v["fields"].items()})
            except TypeError as e:
                raise RuntimeFailure(f"checkpoint data holds a {v['__attrs__']} rpeg cannot "
                                     f"rebuild ({e})"[:300], where) from None
        raise RuntimeFailure(f"checkpoint data holds an unknown entry {sorted(v)[:3]}"[:300],
                             where)

    try:
        return dec(doc)
    except RecursionError:
        raise RuntimeFailure("checkpoint data must nest as rpeg writes it, not this deep",
                             where) from None


def _carry_class(ref: object, path: Path):
    if not isinstance(ref, str) or not ref.startswith(_CARRY_CLASSES) or ref.count(":") != 1:
        raise RuntimeFailure(f"checkpoint data may hold only rpeg's own values, not {ref!r}"
                             [:300], Span(str(path), 0, 0))
    module, name = ref.split(":")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError as e:
        raise RuntimeFailure(f"checkpoint data names a value type in module '{module}', which "
                             f"cannot be imported ({e})"[:300], Span(str(path), 0, 0)) from None
    if cls is None or not attrs.has(cls):
        raise RuntimeFailure(f"checkpoint data names an unknown value type {ref!r}",
                             Span(str(path), 0, 0))
    return cls


# --- worker side: every replica on this worker, saved or restored -------------------------

def replica_versions() -> dict[str, tuple[int, bool, bool, bool]]:
    """In a worker: ``MODEL@DEVICE`` -> (version, trained here, frozen, keeps partial
    rollouts) of each replica."""
    from rpeg.runtime.dask import worker as W
    ex = W.current_executor()
    device = W.current_device()
    frozen = {m.name for m in ex.ctx.pipeline.models if m.frozen}
    # a vLLM engine's own copy (``actor~vllm``) trains nothing and is never rebuilt: its
    # files hold its version and its carried responses
    return {ReplicaAt.of(model, device): (r.version, getattr(r, "optimizer", None) is not None,
                                          of_frozen(model, frozen), ex.carries(model))
            for model, r in ex.replicas.items()}


def of_frozen(key: str, frozen: set[str]) -> bool:
    """Whether the copy ``key`` (``ref``, ``ref~tp0-1``: any copy of it) holds weights
    of frozen models only, which never change."""
    return set(ReplicaKey(key).backbone.members) <= frozen


def save_replicas(root: str, step: int, skip: tuple[str, ...] = ()
                  ) -> tuple[dict[str, int], dict[str, tuple[int, str]]]:
    """In a worker: write each replica it holds to ``root/MODEL@DEVICE`` (but those in
    ``skip``, see ``rpeg.runtime.core.choices.rebuildable``); the versions of all, and
    (size, sha256) of every file it wrote, by path relative to ``root``, hashed here as
    each is written (:func:`hash_written`), so the driver reads none of them back: the
    replica folders are this worker's own, and a backend that writes elsewhere under
    ``root`` (a sharded model's folder of every rank's shards) hashes its own files there."""
    from rpeg.runtime.dask import worker as W
    ex = W.current_executor()
    device = W.current_device()
    out = {}
    _WRITTEN.clear()
    for model, replica in ex.replicas.items():
        key = ReplicaAt.of(model, device)
        if key not in skip:
            ex.checkpoint(model, str(Path(root) / key), {"step": step, "device": device})
            mine = Path(root) / key
            if mine.is_dir():
                hash_written(f for f in sorted(mine.rglob("*")) if f.is_file()
                             and str(f) not in _WRITTEN)
        out[key] = replica.version
    base = Path(root)
    files = {}
    for f, entry in _WRITTEN.items():
        try:
            files[str(Path(f).relative_to(base))] = entry
        except ValueError:                # written outside the checkpoint: not in it
            continue
    _WRITTEN.clear()
    return out, files


# (size, sha256) of the files this process wrote into the checkpoint being written, by path
_WRITTEN: dict[str, tuple[int, str]] = {}


def hash_written(paths) -> None:
    """In a writer: hash the checkpoint files ``paths`` it has just written (and synced),
    while they are in its page cache, for :func:`save_replicas` to return; a backend calls
    it for files it writes outside the replica's own folder."""
    for f in paths:
        f = Path(f)
        _WRITTEN[str(f)] = (f.stat().st_size, _sha256(f))


def restore_replicas(sources: dict[str, str]) -> dict[str, int]:
    """In a worker: load each replica it holds from ``sources[model]``; their versions."""
    from rpeg.runtime.dask import worker as W
    ex = W.current_executor()
    frozen = {m.name for m in ex.ctx.pipeline.models if m.frozen}
    out = {}
    for model, replica in ex.replicas.items():
        if of_frozen(model, frozen):
            out[model] = replica.version         # as built: frozen weights never change
            continue
        if model not in sources:
            raise RuntimeFailure(f"checkpoint must hold model '{model}', and it does not")
        out[model] = ex.restore(model, sources[model])
    return out


# --- helpers -------------------------------------------------------------------------------

def _manifest(tmp: Path, hashed: dict[str, tuple[int, str]] | None = None
              ) -> dict[str, dict]:
    """Every file under ``tmp``: its size and SHA-256, from ``hashed`` where its writer
    hashed it (checked: the file there, of that size), else read and hashed here."""
    hashed = hashed or {}
    out = {}
    for f in sorted(tmp.rglob("*")):
        if not f.is_file():
            continue
        name = str(f.relative_to(tmp))
        size = f.stat().st_size
        if name in hashed:
            want, digest = hashed[name]
            if size != want:
                raise RuntimeFailure(f"checkpoint file '{f}' must be the {want} bytes its "
                                     f"writer hashed, not {size} (written over while "
                                     "committed)", Span(str(f), 0, 0))
        else:
            digest = _sha256(f)
        out[name] = {"size": size, "sha256": digest}
    missing = sorted(set(hashed) - set(out))
    if missing:
        raise RuntimeFailure(f"checkpoint file '{tmp / missing[0]}' its writer hashed must "
                             "be there when committed, and it is not",
                             Span(str(tmp / missing[0]), 0, 0))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_json(path: Path, what: str):
    from rpeg.runtime.rundir import files as rf
    return rf.read_json(path, what, MAX_JSON_BYTES)
