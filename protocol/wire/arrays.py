"""The values of a group's arrays (no negative token id, every log-probability finite and
at most 0), checked for all its completions at once, and for all the groups of a read at
once: numpy's cost per call, not per value, is what a group pays
(`protocol.wire.messages.RolloutGroup`, `protocol.wire.codec.decode_each`)."""

from __future__ import annotations

import io
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING

import numpy as np

from protocol.wire.errors import ProtocolError
from protocol.wire.packing import any_bad_logprob_bits, any_negative, check_token_ids, check_whole_i32, unpack_i32

if TYPE_CHECKING:
    from protocol.wire.messages import Completion, RolloutGroup


def check_group_arrays(prompt_token_ids: bytes, completions: list[Completion]) -> None:
    """`check_token_ids` of the prompt and `Completion.check_arrays` of every completion, as
    one pass over one buffer of all their token ids then all their log-probabilities (read
    as int32: `any_bad_logprob_bits`), a fraction of the cost of a scan each; a failure is
    found again array by array, to name it."""
    check_whole_i32("prompt_token_ids", prompt_token_ids)  # else the ids after it would shift
    if _bad_arrays([prompt_token_ids, *[c.token_ids for c in completions]], [c.logprobs for c in completions]):
        check_token_ids("prompt_token_ids", prompt_token_ids)
        for i, c in enumerate(completions):
            try:
                c.check_arrays()
            except ProtocolError as err:
                raise ProtocolError(f"completions[{i}].{err}") from None


def check_group_versions(adapter_version: int, later_digests: dict[int, str], completions: list[Completion]) -> None:
    """In-flight updates: each completion's versions never decrease and start no older than
    the group's; the oldest token is the group's `adapter_version`; every newer version named
    has its digest in `later_digests`, and no other has."""
    named: set[int] = set()
    oldest: int | None = None
    for i, c in enumerate(completions):
        v = c.token_versions(adapter_version)
        if not v.size:
            continue
        if c.versions is not None and (np.diff(v) < 0).any():
            raise ProtocolError(f"completions[{i}].versions: a token older than the one before it")
        oldest = int(v[0]) if oldest is None else min(oldest, int(v[0]))
        named.update(int(x) for x in np.unique(v))
    if oldest is not None and oldest != adapter_version:
        raise ProtocolError(f"adapter_version: v{adapter_version}, but the oldest token is v{oldest}")
    later = named - {adapter_version}
    if later != set(later_digests):
        raise ProtocolError(
            f"later_digests: names v{sorted(later_digests)}; the completions' newer versions are v{sorted(later)}"
        )


_SCRATCH = threading.local()
_SCRATCH_MOST = 4 << 20
"""Bytes a thread keeps for `_bad_arrays`: more than this are joined anew."""


def _bad_arrays(token_ids: list[bytes], logprobs: list[bytes]) -> bool:
    """Some token id below 0 or some log-probability not one, in one buffer of them all:
    the thread's own, written over each time (a buffer joined anew, half a megabyte for a
    read of 16 groups, made glibc map, fault in and give back its pages each time: a
    third more of a group's decode, measured)."""
    k = sum(map(len, token_ids)) >> 2
    if k * 8 > _SCRATCH_MOST:
        return _bad_words(unpack_i32(b"".join([*token_ids, *logprobs])), k)
    scratch: io.BytesIO | None = getattr(_SCRATCH, "buffer", None)
    if scratch is None:
        scratch = _SCRATCH.buffer = io.BytesIO()
    scratch.seek(0)
    try:
        scratch.writelines(token_ids)
    except BufferError:  # a view of it outlived its check (kept by a traceback): a new one
        scratch = _SCRATCH.buffer = io.BytesIO()
        scratch.writelines(token_ids)
    scratch.writelines(logprobs)
    view = scratch.getbuffer()
    try:
        return _bad_words(unpack_i32(view[: scratch.tell()]), k)
    finally:
        view.release()


def _bad_words(words: np.ndarray, k: int) -> bool:
    return bool(k and any_negative(words[:k])) or (words.size > k and any_bad_logprob_bits(words[k:]))


def check_groups_arrays(groups: list[RolloutGroup]) -> list[ProtocolError | None]:
    """`check_group_arrays` of each group (decoded under `deferred_group_arrays`), as one
    pass over all of them: numpy's cost per call is what a group's arrays cost, so a read
    of 16 groups pays it once. Each group's error or None, in order."""
    if not _bad_arrays(
        [a for g in groups for a in (g.prompt_token_ids, *[c.token_ids for c in g.completions])],
        [c.logprobs for g in groups for c in g.completions],
    ):
        return [None] * len(groups)
    errors: list[ProtocolError | None] = []
    for g in groups:
        try:
            check_group_arrays(g.prompt_token_ids, g.completions)
            errors.append(None)
        except ProtocolError as err:
            errors.append(err)
    return errors


deferred_group_arrays: ContextVar[bool] = ContextVar("deferred_group_arrays", default=False)
"""Set: a `RolloutGroup` made in this context leaves the values of its arrays unchecked
(their shapes are checked), for its maker to check with others (`check_groups_arrays`);
only `protocol.wire.codec.decode_each` sets it, and checks every group it returns."""
