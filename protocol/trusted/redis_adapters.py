"""Adapter announcements on Redis: the latest-version key, the durable `adapter-events`
stream for late joiners, and pub/sub for those listening. `RedisQueue`'s part of the
`Queue` interface for them, kept apart from its leases and rollouts."""

from __future__ import annotations

import time
from typing import TypeVar

from protocol.client.queue import AdapterEvent, AdapterSubscription
from protocol.trusted.redis_base import RedisBase
from protocol.trusted.redis_fields import check_ids, decode_manifest, fields_of, text_of
from protocol.wire.codec import encode
from protocol.wire.errors import ProtocolError
from protocol.wire.messages import AdapterManifest

T = TypeVar("T")


class RedisAdapters(RedisBase):
    """The announcement calls of `RedisQueue`."""

    def announce(self, manifest: AdapterManifest) -> str:
        if not isinstance(manifest, AdapterManifest):
            raise ProtocolError(f"announce: expected AdapterManifest, got {type(manifest).__name__}")
        return text_of(
            self._script(
                "ANNOUNCE",
                [self.keys.adapter_latest, self.keys.adapter_events],
                [
                    manifest.version,
                    encode(manifest),
                    self.keys.adapter_channel,
                    self.config.adapter_events_maxlen,
                ],
            )
        )

    def latest_adapter(self) -> AdapterManifest | None:
        payload = self._call(lambda: self._r.hget(self.keys.adapter_latest, "m"))
        return decode_manifest(payload) if payload else None

    def adapter_events(self, after: str = "0", count: int = 100, block_s: float = 0.0) -> list[AdapterEvent]:
        if after != "0":
            check_ids("after", [after])
        block_ms = self._block_ms(block_s)
        resp = self._call(lambda: self._r.xread({self.keys.adapter_events: after}, count=count, block=block_ms))
        events = []
        for _stream, entries in resp or ():
            for raw_id, flat in entries:
                manifest = decode_manifest(fields_of(flat).get("m"))
                if manifest is not None:
                    events.append(AdapterEvent(event_id=text_of(raw_id), manifest=manifest))
        return events

    def subscribe_adapters(self) -> AdapterSubscription:
        return _RedisAdapterSubscription(self)


class _RedisAdapterSubscription(AdapterSubscription):
    def __init__(self, queue: RedisAdapters) -> None:
        self._queue = queue
        self._pubsub = queue._r.pubsub(ignore_subscribe_messages=True)
        with queue._errors():
            self._pubsub.subscribe(queue.keys.adapter_channel)

    def get(self, timeout_s: float) -> AdapterManifest | None:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            with self._queue._errors():
                msg = self._pubsub.get_message(timeout=max(remaining, 0.0))
            if msg is not None and msg.get("type") == "message":
                manifest = decode_manifest(msg["data"])
                if manifest is not None:
                    return manifest
            if remaining <= 0:
                return None

    def close(self) -> None:
        self._pubsub.close()
