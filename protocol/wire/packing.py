"""Arrays on the wire: token ids and log-probabilities as packed little-endian int32 /
float32 bytes (never lists of Python numbers), and the value checks the messages share."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from protocol.wire.errors import ProtocolError

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_i32(values: Any) -> bytes:
    """Pack integers (a sequence or array) as little-endian int32 bytes."""
    arr = np.asarray(values)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ProtocolError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ProtocolError("token ids must fit in int32")
    return np.ascontiguousarray(arr.reshape(-1), dtype=_I32).tobytes()


def pack_f32(values: Any) -> bytes:
    """Pack floats (a sequence or array) as little-endian float32 bytes."""
    return np.ascontiguousarray(np.asarray(values, dtype=np.float64).reshape(-1), dtype=_F32).tobytes()


def unpack_i32(data: bytes | memoryview) -> np.ndarray:
    """A read-only int32 view of packed bytes (no copy)."""
    return np.frombuffer(data, dtype=_I32)


def unpack_f32(data: bytes) -> np.ndarray:
    """A read-only float32 view of packed bytes (no copy)."""
    return np.frombuffer(data, dtype=_F32)


F32_MAX = float(np.finfo(np.float32).max)
_MIN = np.minimum.reduce  # the ufuncs themselves: ndarray.min() adds a Python-level wrapper
_MAX = np.maximum.reduce


def any_negative(ids: np.ndarray) -> bool:
    """Some token id of a non-empty int32 array is below 0."""
    return bool(_MIN(ids) < 0)


def any_bad_logprob(lp: np.ndarray) -> bool:
    """Some value of a non-empty float32 array is not a log-probability: NaN (which the
    maximum propagates), positive, or infinite (+inf is positive; -inf is the minimum).
    Two float32 reductions: half the cost of a float64 sum's finiteness and a maximum."""
    return not _MAX(lp) <= 0.0 or bool(_MIN(lp) == -math.inf)


_NEG_INF_BITS = -(1 << 23)
"""float32's -inf read as an int32: every finite negative float32 (and -0.0) reads below it;
+0.0 reads 0, positives, +inf and NaNs of either sign at or above it."""


def any_bad_logprob_bits(words: np.ndarray) -> bool:
    """`any_bad_logprob` of a non-empty array of float32 log-probabilities read as int32:
    one integer reduction where every value is finite and below zero (or -0.0), as sampled
    log-probabilities almost always are; the float reductions only where one is not (a
    +0.0, an episode's environment token, or a bad value)."""
    return not _MAX(words) < _NEG_INF_BITS and any_bad_logprob(words.view(_F32))


def all_finite(values: Iterable[float]) -> bool:
    return all(map(math.isfinite, values))


def all_f32(values: Iterable[float | None]) -> bool:
    """Every value None or finite in float32 (`check_f32` passes it)."""
    return all(v is None or -F32_MAX <= v <= F32_MAX for v in values)


def check_whole_i32(field: str, data: bytes) -> None:
    if len(data) % 4:
        raise ProtocolError(f"{field}: {len(data)} bytes is not a whole number of int32 values")


def check_token_ids(field: str, data: bytes) -> int:
    check_whole_i32(field, data)
    ids = unpack_i32(data)
    if ids.size and any_negative(ids):
        raise ProtocolError(f"{field}: negative token id {int(ids.min())}")
    return ids.size


def check_json_like(field: str, value: Any, depth: int) -> None:
    """Dataset columns must survive a JSON round trip: no bytes, no extension types."""
    if depth > 32:
        raise ProtocolError(f"{field}: nested more than 32 levels deep")
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        check_finite(field, value)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_json_like(f"{field}[{i}]", item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(f"{field}: keys must be strings")
            check_json_like(f"{field}[{key!r}]", item, depth + 1)
    else:
        raise ProtocolError(f"{field}: {type(value).__name__} is not a JSON value")


def check_finite(field: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise ProtocolError(f"{field}: must be finite, got {value}")


def check_f32(field: str, value: float | None) -> None:
    """Finite in float32, where the learner computes: 1e39 is finite in float64 and inf there."""
    if value is not None and not (math.isfinite(value) and abs(value) <= F32_MAX):
        raise ProtocolError(f"{field}: must be finite in float32 (|x| <= {F32_MAX:.3g}), got {value}")
