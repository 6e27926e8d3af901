"""The files of an adapter or a checkpoint as both sides name and check them: the store's
key layout (DESIGN.md, "Object store layout"), each file's digest, and the errors a
read of the store raises. The trusted side writes the store (`protocol.trusted.store`);
a worker only reads what the proxy hands out, and checks it here.

    adapters/v<N>/{adapter_model.safetensors, adapter_config.json, manifest.json}
    checkpoints/step-<S>/...      checkpoints/latest.json
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

from protocol.wire.errors import ProtocolError
from protocol.wire.messages import AdapterFile

MANIFEST = "manifest.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
CHECKPOINT_POINTER = "checkpoints/latest.json"

_VERSION_DIR = re.compile(r"^adapters/v(\d+)/")
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$")


class StoreError(OSError):
    """The store could not complete an operation (after retries, where retrying applies)."""


class StoreMissing(StoreError, FileNotFoundError):
    """The key does not exist."""


def adapter_key(version: int, name: str) -> str:
    """Key of one file of adapter `version`."""
    if version < 1:
        raise ValueError(f"adapter version must be >= 1, got {version}")
    return check_key(f"adapters/v{version}/{name}")


def checkpoint_key(step: int, name: str) -> str:
    return check_key(f"checkpoints/step-{step}/{name}")


def check_key(key: str) -> str:
    """Refuse keys that could leave the store's prefix (`..`, absolute, hidden parts)."""
    if not _KEY.match(key) or ".." in key.split("/"):
        raise ValueError(f"store key {key!r} is not a plain relative path")
    return key


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_entry(name: str, data: bytes) -> AdapterFile:
    return AdapterFile(name=name, sha256=sha256_hex(data), size=len(data))


def adapter_digest(files: Iterable[AdapterFile]) -> str:
    """One digest for a whole adapter: sha256 of each file's name and sha256, in name
    order. What a group carries as proof of the adapter it was generated with; the same
    for the manifest the learner wrote and the folder a worker loaded."""
    lines = sorted(f"{f.name} {f.sha256}\n" for f in files)
    return sha256_hex("".join(lines).encode())


def folder_digest(folder: Path) -> str:
    """`adapter_digest` of the files in `folder` as they are on disk (what an engine
    loaded from it)."""
    return adapter_digest(file_entry(p.name, p.read_bytes()) for p in sorted(folder.iterdir()) if p.is_file())


def verify(entry: AdapterFile, data: bytes) -> None:
    """Raise ProtocolError unless `data` is the file the manifest describes."""
    if len(data) != entry.size:
        raise ProtocolError(f"{entry.name}: {len(data)} bytes, manifest says {entry.size}")
    digest = sha256_hex(data)
    if digest != entry.sha256:
        raise ProtocolError(f"{entry.name}: sha256 {digest} does not match the manifest")
