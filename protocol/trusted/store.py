"""The object store: where adapters and checkpoints live, behind one small interface.

Two backends: `file:///path` (one machine) and `s3://bucket/prefix` (boto3, with the
endpoint and credentials from the standard AWS variables, `AWS_ENDPOINT_URL` for
MinIO, R2 and the like). Keys are relative to the URL's prefix and use `/`.

The layout (DESIGN.md, "Object store layout") is spelled out once here:

    adapters/v<N>/{adapter_model.safetensors, adapter_config.json, manifest.json}
    checkpoints/step-<S>/...      checkpoints/latest.json

Writers put a version's files first and its manifest (or a checkpoint's pointer)
last, so a reader that finds the manifest finds complete files. Only safetensors and
JSON are read back from a store.
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import functools
import itertools
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from protocol.client.adapters import AdapterSource
from protocol.util.retry import retry
from protocol.wire.codec import from_json
from protocol.wire.errors import ProtocolError
from protocol.wire.files import (
    _VERSION_DIR,
    MANIFEST,
    StoreError,
    StoreMissing,
    adapter_key,
    check_key,
)
from protocol.wire.messages import AdapterManifest

T = TypeVar("T")


class Store(abc.ABC):
    """A flat key -> bytes store with atomic whole-object writes."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Raises StoreMissing when the key does not exist."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str) -> builtins.list[str]:
        """Keys under `prefix` (a folder key ending in `/`), sorted."""

    @abc.abstractmethod
    def delete(self, keys: builtins.list[str]) -> None: ...

    def presign(self, key: str, expires_s: int) -> str | None:
        """A URL that fetches `key` without credentials, or None if the backend has none."""
        return None

    # -- adapter helpers, shared by the learner (writer) and the proxy (reader)
    def adapter_files(self) -> dict[int, builtins.list[str]]:
        """The keys under `adapters/`, by version (pruning and `learner export` read this)."""
        found: dict[int, builtins.list[str]] = {}
        for key in self.list("adapters/"):
            if (m := _VERSION_DIR.match(key)) is not None:
                found.setdefault(int(m[1]), []).append(key)
        return found

    def read_manifest(self, version: int) -> AdapterManifest:
        manifest = from_json(self.get(adapter_key(version, MANIFEST)))
        if not isinstance(manifest, AdapterManifest):
            raise ProtocolError(f"v{version}/{MANIFEST}: not an adapter manifest")
        if manifest.version != version:
            raise ProtocolError(f"manifest of v{version} says version {manifest.version}")
        return manifest


class FileStore(Store):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # write-then-rename: a reader sees the old object or the new one, never half
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            raise StoreError(f"{self.url}: cannot write {key}: {err}") from err

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StoreMissing(f"{self.url}: no object {key}") from None
        except OSError as err:
            raise StoreError(f"{self.url}: cannot read {key}: {err}") from err

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> builtins.list[str]:
        base = self.root / prefix.rstrip("/") if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            p.relative_to(self.root).as_posix()
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")
        )

    def delete(self, keys: builtins.list[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # folders left empty go too, like S3 "folders"
                for parent in path.relative_to(self.root).parents[:-1]:
                    (self.root / parent).rmdir()

    def local_path(self, key: str) -> Path:
        """Where `key` lies on disk (the proxy streams file:// adapters itself)."""
        return self._path(key)


class S3Store(Store):
    def __init__(
        self, bucket: str, prefix: str = "", client: object | None = None, presign_endpoint: str | None = None
    ) -> None:
        """`presign_endpoint`: the address presigned URLs name, when the workers reach the
        bucket at another address than this process (MinIO inside compose as
        `http://minio:9000`, outside as `https://s3.example.com`). boto3 has no setting
        for a public endpoint, and a presigned URL signs its host, so a second client
        with that endpoint signs them (locally: signing makes no request)."""
        import boto3  # only s3:// users need boto3 on the import path
        from botocore.config import Config

        config = Config(retries={"max_attempts": 3, "mode": "standard"})
        if client is None:
            client = boto3.client("s3", config=config)
        self.client: Any = client
        self.presign_client: Any = client
        if presign_endpoint is not None:
            parsed = urlparse(presign_endpoint)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"presign endpoint {presign_endpoint!r}: expected http(s)://host[:port]")
            self.presign_client = boto3.client("s3", config=config, endpoint_url=presign_endpoint)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise StoreMissing(f"{self.url}: no object for {what}") from None
            raise StoreError(f"{self.url}: {what} failed: {code} {err}") from err
        except BotoCoreError as err:
            raise StoreError(f"{self.url}: {what} failed: {err}") from err

    def put(self, key: str, data: bytes) -> None:
        self._call(
            f"put {key}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data),
        )

    def get(self, key: str) -> bytes:
        response = self._call(f"get {key}", lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key)))
        data: bytes = self._call(f"get {key}", lambda: response["Body"].read())
        return data

    def exists(self, key: str) -> bool:
        try:
            self._call(
                f"head {key}",
                lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)),
            )
        except StoreMissing:
            return False
        return True

    def list(self, prefix: str) -> builtins.list[str]:
        full = self._key(prefix.rstrip("/")) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []

        def page_through() -> None:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))

        self._call(f"list {prefix}", page_through)
        return sorted(keys)

    def delete(self, keys: builtins.list[str]) -> None:
        for i in range(0, len(keys), 1000):
            chunk = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            self._call(
                "delete",
                functools.partial(
                    self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": chunk, "Quiet": True}
                ),
            )

    def presign(self, key: str, expires_s: int) -> str | None:
        url: str | None = self._call(
            f"presign {key}",
            lambda: self.presign_client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self._key(key)},
                ExpiresIn=expires_s,
            ),
        )
        return url


class StoreSource(AdapterSource):
    """Adapter files straight from the object store (file://, or s3:// with credentials): the
    trusted side's reader; a worker reads through the proxy (`actors.watcher.ProxySource`)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def fetch(self, manifest: AdapterManifest, name: str) -> bytes:
        return self.store.get(adapter_key(manifest.version, name))

    def manifest(self, version: int) -> AdapterManifest:
        return self.store.read_manifest(version)


def open_store(url: str, presign_endpoint: str | None = None) -> Store:
    """`file:///abs/path`, a plain local path, or `s3://bucket[/prefix]` (with, for the
    proxy, the public endpoint its presigned URLs name)."""
    parsed = urlparse(url)
    if presign_endpoint is not None and parsed.scheme != "s3":
        raise ValueError(f"presign endpoint: only for an s3:// store, not {url!r} (a file store is streamed)")
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store {url!r}: s3:// URLs need a bucket (s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path, presign_endpoint=presign_endpoint)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"store {url!r}: file:// URLs take an absolute path (file:///dir)")
        return FileStore(parsed.path)
    if parsed.scheme == "":
        return FileStore(url)
    raise ValueError(f"store {url!r}: use file:///path or s3://bucket/prefix")


def retrying(
    fn: Callable[[], T],
    *,
    what: str,
    retry_on: tuple[type[Exception], ...] = (StoreError,),
    attempts: int = 5,
    base_s: float = 0.5,
    max_s: float = 10.0,
    on_retry: Callable[[int, Exception], None] | None = None,
) -> T:
    """Call `fn`, retrying the `retry_on` errors (`protocol.util.retry`). A missing key is never
    retried. A store that still fails raises StoreError("gave up ..."); any other error is
    re-raised as it was after the last attempt."""
    failures = itertools.count(1)

    def before_wait(err: BaseException, _delay: float) -> None:
        if on_retry is not None and isinstance(err, Exception):
            on_retry(next(failures), err)

    try:
        return retry(
            fn, on=retry_on, never=(StoreMissing,), attempts=attempts, first=base_s, cap=max_s, before_wait=before_wait
        )
    except StoreMissing:
        raise
    except StoreError as err:
        raise StoreError(f"{what}: gave up after {attempts} attempts: {err}") from err
