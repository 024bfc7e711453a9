"""Checkpoints written by the workers: the on-disk format, shared by the controller (which commits
them) and the workers (which write and read their own tensors).

A checkpoint is a directory::

    PATH/current                     the name of the complete version (replaced atomically)
    PATH/v000004-<id>/manifest.json  step, layout, optimizer, which file holds which tensor
    PATH/v000004-<id>/rank0-tp0.safetensors ...

Every worker of replica 0 writes its own stages' parameters, buffers and optimizer state to one
safetensors file (no pickle anywhere) under keys ``param/NAME``, ``buffer/NAME`` and
``optim/NAME/STATE``, named as in the model. Tensor-parallel pieces are written as they are held;
the manifest records how each parameter is cut (atoll.core.shards), so a reader in any other
layout joins the pieces and cuts its own. The controller writes the manifest once every worker has
written, then points ``current`` at the version: a save that fails part-way leaves ``current``
pointing at the previous complete checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import signal
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from atoll.core.shards import ParamShard
from atoll.errors import InvalidInput

FORMAT = "atoll-checkpoint-1"
MANIFEST = "manifest.json"
CURRENT = "current"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FAILPOINT = "ATOLL_FAILPOINT"
"""``checkpoint-write:GLOB``: a process writing a checkpoint file whose path matches GLOB dies
(SIGKILL) half-way through it, to test that a crash mid-save loses nothing (tests/test_checkpoint.py)."""


def _crash_here(path: Path, tmp: Path) -> None:
    kind, _, pattern = os.environ.get(FAILPOINT, "").partition(":")
    if kind == "checkpoint-write" and fnmatch.fnmatch(str(path), pattern):
        os.truncate(tmp, os.path.getsize(tmp) // 2)  # what a crash mid-write leaves on disk
        os.kill(os.getpid(), signal.SIGKILL)


def _replace_file(path: Path, write) -> None:
    """Write through a temporary name, flush it to disk, then rename it into place. The file is
    the owner's alone (0600) from its creation: it holds a model's weights."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))  # writers keep an existing file's mode
    write(tmp)
    _crash_here(path, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def new_version(root: str | os.PathLike, step: int) -> Path:
    """A fresh, empty version directory under ``root`` (created, with ``root``, if missing); both
    are created the owner's alone (0700)."""
    root = Path(root)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    version = root / f"v{step:06d}-{uuid.uuid4().hex[:8]}"
    version.mkdir(mode=0o700)
    return version


def worker_file(rank: int, tp: int) -> str:
    return f"rank{rank}-tp{tp}.safetensors"


def write_tensors(version: Path, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """One worker's tensors into ``version/name``; returns key -> [shape, dtype] for the manifest."""
    if not version.is_dir():
        raise InvalidInput(f"checkpoint version directory {version} does not exist")
    plain = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    _replace_file(version / name, lambda tmp: save_file(plain, str(tmp)))
    return {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in plain.items()}


def commit(version: Path, manifest: dict) -> None:
    """Write the manifest, then point ``current`` at ``version``; older versions are removed."""
    manifest = {"format": FORMAT, **manifest}
    _replace_file(version / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
    root = version.parent
    _replace_file(root / CURRENT, lambda tmp: tmp.write_text(version.name + "\n"))
    for old in root.iterdir():
        if old.is_dir() and old.name.startswith("v") and old.name != version.name:
            shutil.rmtree(old, ignore_errors=True)


def discard(version: Path) -> None:
    """Remove a version that was never committed (a save that failed)."""
    shutil.rmtree(version, ignore_errors=True)


def open_current(root: str | os.PathLike) -> tuple[Path, dict]:
    """The committed version of the checkpoint at ``root`` and its manifest."""
    root = Path(root)
    try:
        name = (root / CURRENT).read_text().strip()
        version = root / name
        manifest = json.loads((version / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{root} holds no complete atoll checkpoint: {type(e).__name__}: {e}") from None
    if manifest.get("format") != FORMAT or "/" in name or name.startswith("."):
        raise InvalidInput(f"{root}: not an atoll checkpoint of format {FORMAT}")
    return version, manifest


class Reader:
    """Whole tensors of a committed checkpoint, whatever layout wrote them."""

    def __init__(self, version: Path, manifest: dict):
        self.version = version
        self.cuts = {name: ParamShard.from_json(c) for name, c in manifest.get("cuts", {}).items()}
        self.tp = int(manifest["layout"]["tensor"])
        self.where: dict[str, dict[int, str]] = {}  # key -> island rank -> file
        for entry in manifest["files"]:
            for key in entry["keys"]:
                self.where.setdefault(key, {}).setdefault(int(entry["tp"]), entry["file"])

    def _read(self, file: str, key: str) -> torch.Tensor:
        with safe_open(str(self.version / file), framework="pt") as f:
            return f.get_tensor(key)

    def full(self, key: str, name: str) -> torch.Tensor:
        """``key`` (of parameter ``name``, for its cut) as one whole tensor."""
        holders = self.where.get(key)
        if not holders:
            raise InvalidInput(f"the checkpoint at {self.version.parent} has no {key}")
        cut = self.cuts.get(name)
        first = self._read(next(iter(holders.values())), key)
        if cut is None or first.dim() == 0:
            return first
        if sorted(holders) != list(range(self.tp)):
            raise InvalidInput(f"the checkpoint lacks some tensor-parallel pieces of {key}")
        return cut.join([self._read(holders[t], key) for t in range(self.tp)])
