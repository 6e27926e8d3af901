"""Where a worker's adapter files come from (`AdapterSource`): through the proxy's
presigned downloads on a worker (`actors.watcher.ProxySource`), or straight from the
object store on the trusted side (`protocol.trusted.store.StoreSource`: tests, benchmarks,
in-process runs)."""

from __future__ import annotations

import abc

from protocol.wire.messages import AdapterManifest


class AdapterSource(abc.ABC):
    """Where an actor downloads adapter files from."""

    @abc.abstractmethod
    def fetch(self, manifest: AdapterManifest, name: str) -> bytes: ...

    @abc.abstractmethod
    def manifest(self, version: int) -> AdapterManifest:
        """The manifest of a published version (an older one, for an evaluation)."""

    def forget(self) -> None:  # noqa: B027 - most sources keep nothing between fetches
        """Drop what a failed download kept (URLs that may have expired): the next fetch asks again."""
