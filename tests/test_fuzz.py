"""Whatever bytes arrive, `decode` either returns a valid message or raises ProtocolError."""

from __future__ import annotations

from typing import Any

import msgspec
from factories import batch, chat_batch, group, manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import Message, ProtocolError, decode, encode

VALID = [encode(m) for m in (batch(), chat_batch(), group(batch()), manifest())]
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_reject(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    # anything accepted must be a real message that survives its own round trip
    assert isinstance(msg, Message)
    assert decode(encode(msg)) == msg


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    decode_or_reject(data)


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_mutated_messages(valid: bytes, data: st.DataObject) -> None:
    buf = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        pos = data.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[pos] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del buf[pos:]
        elif op == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and buf:
            del buf[pos : pos + data.draw(st.integers(1, 8))]
    decode_or_reject(bytes(buf))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@FUZZ
@given(st.sampled_from(VALID), st.data(), msgpack_values)
def test_wrong_values_in_valid_structure(valid: bytes, data: st.DataObject, value: Any) -> None:
    doc = msgspec.msgpack.decode(valid)
    path = data.draw(st.sampled_from(_paths(doc)))
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    decode_or_reject(msgspec.msgpack.encode(doc))
