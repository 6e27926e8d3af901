"""Round trips and rejections for every wire message."""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from factories import batch, chat_batch, completion, group, manifest

import protocol
from protocol import (
    Completion,
    Limits,
    PromptBatch,
    ProtocolError,
    decode,
    encode,
    from_json,
    pack_f32,
    pack_i32,
    to_json,
)


def as_dict(msg: protocol.Message) -> dict[str, Any]:
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def raw(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    "msg",
    [batch(), chat_batch(), group(batch()), manifest()],
    ids=["prompt_batch", "chat_batch", "rollout_group", "adapter_manifest"],
)
def test_round_trip(msg: protocol.Message) -> None:
    data = encode(msg)
    back = decode(data)
    assert back == msg
    assert type(back) is type(msg)
    assert msgspec.msgpack.decode(data)["schema"] == protocol.SCHEMA_VERSION


def test_arrays_travel_packed_little_endian() -> None:
    g = group(batch(), tokens=3)
    data = encode(g)
    c = g.completions[0]
    assert np.array([10, 11, 12], dtype="<i4").tobytes() in data
    assert np.array([-0.25] * 3, dtype="<f4").tobytes() in data
    back = decode(data)
    assert isinstance(back, protocol.RolloutGroup)
    assert back.completions[0].tokens.tolist() == c.tokens.tolist() == [10, 11, 12]
    assert back.completions[0].logps.dtype == np.float32
    assert back.prompt_tokens.tolist() == [1, 2, 3]


def test_optional_fields_keep_their_meaning() -> None:
    b = batch()
    g = group(b)
    failed = msgspec.structs.replace(
        g,
        error="reward timed out after 5s",
        completions=[completion(reward=None, error="reward timed out after 5s", reward_components={"acc": None})],
    )
    back = decode(encode(failed))
    assert back.error == "reward timed out after 5s"
    assert back.completions[0].reward is None
    assert back.completions[0].reward_components == {"acc": None}


def test_manifest_json_round_trip() -> None:
    m = manifest(version=7, step=70)
    assert from_json(to_json(m)) == m
    with pytest.raises(ProtocolError, match="version"):
        from_json(to_json(m).replace(b'"version":7', b'"version":-7'))


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.pop(key)


NAN_LOGPROBS = pack_f32([-0.1, float("nan"), -0.2, -0.3])
INF_LOGPROBS = pack_f32([-0.1, float("-inf"), -0.2, -0.3])
POSITIVE_LOGPROBS = pack_f32([-0.1, 0.5, -0.2, -0.3])

REJECTIONS: list[tuple[str, Callable[[], protocol.Message], Callable[[dict[str, Any]], None], str]] = [
    ("unknown schema", batch, _set(["schema"], 99), "schema"),
    ("missing schema", batch, _drop("schema"), "schema"),
    ("unknown type", batch, _set(["type"], "launch_missiles"), "type"),
    ("batch id wrong type", batch, _set(["batch_id"], 17), "batch_id"),
    ("empty batch id", batch, _set(["batch_id"], ""), "batch_id"),
    ("num_generations zero", batch, _set(["num_generations"], 0), "num_generations"),
    ("negative learner version", batch, _set(["learner_version"], -1), "learner_version"),
    ("temperature negative", batch, _set(["sampling", "temperature"], -1.0), "sampling.temperature"),
    ("top_p zero", batch, _set(["sampling", "top_p"], 0.0), "sampling.top_p"),
    ("no prompts", batch, _set(["prompts"], []), "prompts"),
    ("prompt without content", batch, _set(["prompts", 0], {"id": "x"}), "prompts[0]"),
    ("duplicate prompt ids", batch, _set(["prompts", 1, "id"], "p0"), "prompts"),
    ("column of bytes", batch, _set(["prompts", 0, "columns", "blob"], b"\x00"), "columns"),
    ("column NaN", batch, _set(["prompts", 0, "columns", "x"], float("nan")), "columns"),
    ("unknown field", batch, _set(["surprise"], 1), "surprise"),
    ("negative adapter version", lambda: group(batch()), _set(["adapter_version"], -3), "adapter_version"),
    ("group id not derived", lambda: group(batch()), _set(["group_id"], "forged"), "group_id"),
    ("no completions", lambda: group(batch()), _set(["completions"], []), "completions"),
    ("ragged token bytes", lambda: group(batch()), _set(["completions", 0, "token_ids"], b"\x01\x00\x00"), "token_ids"),
    (
        "negative token id",
        lambda: group(batch()),
        _set(["completions", 0, "token_ids"], pack_i32([1, -2, 3, 4])),
        "token_ids",
    ),
    (
        "negative prompt token id",
        lambda: group(batch()),
        _set(["prompt_token_ids"], pack_i32([1, -2])),
        "prompt_token_ids",
    ),
    (
        "ragged prompt token bytes",
        lambda: group(batch()),
        _set(["prompt_token_ids"], b"\x01\x00\x00"),
        "prompt_token_ids",
    ),
    (
        "+inf log-probability",
        lambda: group(batch()),
        _set(["completions", 1, "logprobs"], pack_f32([-0.1, float("inf"), -0.2, -0.3])),
        "completions[1].logprobs",
    ),
    ("length mismatch", lambda: group(batch()), _set(["completions", 0, "logprobs"], pack_f32([-0.1] * 3)), "logprobs"),
    ("NaN log-probability", lambda: group(batch()), _set(["completions", 0, "logprobs"], NAN_LOGPROBS), "logprobs"),
    (
        "infinite log-probability",
        lambda: group(batch()),
        _set(["completions", 0, "logprobs"], INF_LOGPROBS),
        "logprobs",
    ),
    (
        "positive log-probability",
        lambda: group(batch()),
        _set(["completions", 0, "logprobs"], POSITIVE_LOGPROBS),
        "logprobs",
    ),
    ("logprobs as a list", lambda: group(batch()), _set(["completions", 0, "logprobs"], [-0.1] * 4), "logprobs"),
    (
        "unknown finish reason",
        lambda: group(batch()),
        _set(["completions", 0, "finish_reason"], "tired"),
        "finish_reason",
    ),
    ("reward NaN", lambda: group(batch()), _set(["completions", 0, "reward"], float("nan")), "reward"),
    (
        "reward component inf",
        lambda: group(batch()),
        _set(["completions", 0, "reward_components", "acc"], float("inf")),
        "reward_components",
    ),
    ("log_extra value too long", lambda: group(batch()), _set(["completions", 0, "extra", "why"], "w" * 301), "extra"),
    ("log_extra unsafe name", lambda: group(batch()), _set(["completions", 0, "extra", "a\x1b[2J"], "x"), "extra"),
    ("log_extra terminal escape", lambda: group(batch()), _set(["completions", 0, "extra", "why"], "\x1b[2J"), "extra"),
    ("timing NaN", lambda: group(batch()), _set(["timings", "generate_s"], float("nan")), "timings"),
    ("manifest version zero", manifest, _set(["version"], 0), "version"),
    ("manifest negative step", manifest, _set(["step"], -1), "step"),
    ("file name escapes", manifest, _set(["files", 0, "name"], "../../etc/passwd"), "files[0].name"),
    ("file name hidden", manifest, _set(["files", 0, "name"], ".env"), "files[0].name"),
    ("bad sha256", manifest, _set(["files", 0, "sha256"], "XYZ"), "files[0].sha256"),
    ("negative size", manifest, _set(["files", 0, "size"], -1), "files[0].size"),
    ("duplicate file names", manifest, _set(["files", 1, "name"], "adapter_model.safetensors"), "files"),
]


@pytest.mark.parametrize(("make", "mutate", "field"), [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_rejection_names_the_field(
    make: Callable[[], protocol.Message], mutate: Callable[[dict[str, Any]], None], field: str
) -> None:
    d = as_dict(make())
    decode(raw(d))  # the unmutated message is fine
    mutate(d)
    with pytest.raises(ProtocolError) as info:
        decode(raw(d))
    assert field in str(info.value)


GROUP_REJECTIONS = [r for r in REJECTIONS if r[1] not in (batch, manifest)]


@pytest.mark.parametrize(("mutate", "field"), [r[2:] for r in GROUP_REJECTIONS], ids=[r[0] for r in GROUP_REJECTIONS])
def test_a_read_of_many_groups_refuses_the_bad_one_alone_and_names_its_field(
    mutate: Callable[[dict[str, Any]], None], field: str
) -> None:
    """`decode_each` checks the groups' arrays together (one pass for all): a bad group
    among good ones is refused as `decode` refuses it, the others come through."""
    from protocol.wire.codec import decode_each

    goods = [group(batch(i), completions=3) for i in range(4)]
    bad = as_dict(group(batch(9)))
    mutate(bad)
    out = decode_each([encode(goods[0]), encode(goods[1]), raw(bad), encode(goods[2]), b"\xc1", encode(goods[3])])
    assert [out[i] for i in (0, 1, 3, 5)] == goods
    assert isinstance(out[2], ProtocolError) and field in str(out[2])
    with pytest.raises(ProtocolError) as info:
        decode(raw(bad))
    assert str(out[2]) == str(info.value)  # the same words, found by the same checks
    assert isinstance(out[4], ProtocolError)


@pytest.mark.parametrize("logprob", [0.0, -0.0, -3.4e38, -1e-45, -88.0])
def test_every_log_probability_at_or_below_zero_passes_on_either_path(logprob: float) -> None:
    """The values a float32 log-probability may take, in a group alone and in a read of
    several (where one integer reduction passes the usual ones and the rest are checked as
    floats: +0.0 is one)."""
    from protocol.wire.codec import decode_each

    g = group(batch())
    d = as_dict(g)
    d["completions"][1]["logprobs"] = pack_f32([-0.5, logprob, -0.25, -1.0])
    assert decode(raw(d)).completions[1].logps[1] == np.float32(logprob)  # type: ignore[union-attr]
    assert decode_each([encode(g), raw(d)])[1] == decode(raw(d))


def test_a_negative_nan_log_probability_is_refused_on_either_path() -> None:
    from protocol.wire.codec import decode_each

    d = as_dict(group(batch()))
    d["completions"][0]["logprobs"] = pack_f32([-0.5, -0.5, -0.5]) + np.array([0xFFC00000], dtype="<u4").tobytes()
    with pytest.raises(ProtocolError, match="logprobs"):
        decode(raw(d))
    out = decode_each([encode(group(batch(1))), raw(d)])
    assert isinstance(out[1], ProtocolError) and "logprobs" in str(out[1])


@pytest.mark.parametrize(
    ("limits", "make", "field"),
    [
        (Limits(max_message_bytes=100), batch, "message"),
        (Limits(max_prompts=1), lambda: batch(prompts=2), "prompts"),
        (Limits(max_completions=3), lambda: group(batch(), completions=4), "completions"),
        (Limits(max_completions=3), batch, "num_generations"),
        (Limits(max_tokens=16), lambda: group(batch(), tokens=17), "completions[0].token_ids"),
        (Limits(max_tokens=100), batch, "sampling.max_tokens"),
        (Limits(max_text_chars=5), batch, "prompts[0].text"),
    ],
)
def test_limits(limits: Limits, make: Callable[[], protocol.Message], field: str) -> None:
    data = encode(make())
    with pytest.raises(ProtocolError, match=field.replace("[", r"\[").replace("]", r"\]")):
        decode(data, limits)


def test_a_groups_limits_hold_at_their_bounds_and_name_the_field_past_them() -> None:
    """A group's sizes are checked longest-first and named only past the bound: exactly at
    it passes, one past it is refused naming the completion (or the prompt)."""

    def long(completion: int, tokens: int = 0, text: int = 0, prompt: int = 3) -> protocol.RolloutGroup:
        g = group(batch(), completions=3)
        cs = list(g.completions)
        cs[completion] = msgspec.structs.replace(cs[completion], text="x" * text)
        if tokens:
            cs[completion] = msgspec.structs.replace(
                cs[completion], token_ids=pack_i32([1] * tokens), logprobs=pack_f32([-0.5] * tokens)
            )
        return msgspec.structs.replace(g, completions=cs, prompt_token_ids=pack_i32([1] * prompt))

    limits = Limits(max_tokens=16, max_text_chars=5)
    for ok in (long(2, tokens=16), long(1, text=5), long(0, prompt=16)):
        decode(encode(ok), limits)
    for bad, field in (
        (long(2, tokens=17), "completions[2].token_ids"),
        (long(1, text=6), "completions[1].text"),
        (long(0, prompt=17), "prompt_token_ids"),
    ):
        with pytest.raises(ProtocolError, match=re.escape(field)):
            decode(encode(bad), limits)


def test_hostile_length_prefix_allocates_nothing() -> None:
    # a valid start, then a bin32 header announcing ~4 GB that the input does not hold
    head = raw({"type": "rollout_group", "schema": protocol.SCHEMA_VERSION})
    hostile = bytes([head[0] + 1]) + head[1:] + raw("prompt_token_ids") + b"\xc6\xff\xff\xff\xf0" + b"\x00" * 64
    for data in (hostile, b"\xdd\xff\xff\xff\xf0", b"\xdf\xff\xff\xff\xf0", b"\xdb\xff\xff\xff\xf0abc"):
        already_tracing = tracemalloc.is_tracing()
        tracemalloc.start()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        try:
            with pytest.raises(ProtocolError):
                decode(data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            if not already_tracing:
                tracemalloc.stop()
        assert peak - before < 1_000_000


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x91" * 100_000, raw([1, 2, 3]), raw("x"), raw(None)])
def test_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize("data", ["text", 12, None, [b"x"]])
def test_not_bytes(data: Any) -> None:
    with pytest.raises(ProtocolError, match="expected bytes"):
        decode(data)


def test_bad_messages_cannot_be_built_or_sent() -> None:
    with pytest.raises(ProtocolError, match="logprobs"):
        Completion.of([1, 2], [-0.1, float("nan")], finish_reason="stop")
    with pytest.raises(ProtocolError, match="logprobs"):
        Completion.of([1, 2], [-0.1], finish_reason="stop")
    # built field by field, a completion's values are checked by the group that holds it
    nan = Completion(token_ids=pack_i32([1, 2]), logprobs=pack_f32([-0.1, float("nan")]), finish_reason="stop")
    with pytest.raises(ProtocolError, match=r"completions\[1\]\.logprobs: NaN"):
        msgspec.structs.replace(group(batch()), completions=[group(batch()).completions[0], nan])
    with pytest.raises(ProtocolError, match="group_id"):
        msgspec.structs.replace(group(batch()), prompt_id="p1")
    with pytest.raises(ProtocolError, match="int32"):
        pack_i32([2**40])
    # bounds msgspec checks only on decode are enforced by encode too
    bad = msgspec.structs.replace(batch(), learner_version=-1)
    with pytest.raises(ProtocolError, match="learner_version"):
        encode(bad)
    with pytest.raises(ProtocolError):
        encode({"type": "prompt_batch"})


def test_decode_is_the_only_door_for_types() -> None:
    # a message whose tag says one type must carry that type's fields
    d = as_dict(batch())
    d["type"] = "rollout_group"
    with pytest.raises(ProtocolError):
        decode(raw(d))
    assert isinstance(decode(encode(batch())), PromptBatch)
