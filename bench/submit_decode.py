"""What the proxy spends per submitted group between the body and the queue: decoding it,
and naming it after the token's worker (`decode_submit` and `CheckedGroups.named`), against
the code before (`decode_body` and `msgspec.structs.force_setattr` on the decoded structs),
in the same process. The door's whole cost is ~0.5-0.6 ms of proxy CPU a group
(`bench/proxy.py`).

Usage: python bench/submit_decode.py [--groups 8] [--tokens 512] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import time

import msgspec

from protocol import Completion, RolloutGroup, group_id_for, pack_i32
from protocol.client.http import SubmitRequest, decode_body, decode_submit, encode_body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    groups = [
        RolloutGroup(
            group_id=group_id_for("b", f"p{i}"),
            batch_id="b",
            prompt_id=f"p{i}",
            adapter_version=0,
            actor_id="w",
            prompt_token_ids=pack_i32([1, 2, 3]),
            completions=[
                Completion.of(list(range(10, 10 + args.tokens)), [-0.25] * args.tokens, finish_reason="stop", reward=r)
                for r in (0.0, 1.0, 0.0, 1.0)
            ],
        )
        for i in range(args.groups)
    ]
    body = encode_body(SubmitRequest(worker="w", lease_id="1-0", groups=groups))

    def before() -> None:
        for g in decode_body(body, SubmitRequest).groups:
            msgspec.structs.force_setattr(g, "actor_id", "fleet/w")

    def now() -> None:
        decode_submit(body).groups.named("fleet/w")

    per_group: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(3):  # alternated, so that a slower phase of the machine hits both
        for name, fn in (("before", before), ("now", now)):
            started = time.perf_counter()
            for _ in range(args.rounds):
                fn()
            per_group[name].append((time.perf_counter() - started) / args.rounds / args.groups * 1e6)
    b, n = min(per_group["before"]), min(per_group["now"])
    print(f"{args.groups} groups of 4 x {args.tokens} tokens a submission ({len(body)} bytes), best of 3:")
    print(f"  decode_body + force_setattr   {b:6.1f} us a group")
    print(f"  decode_submit + named         {n:6.1f} us a group   ({n / b:.2f}x, +{n - b:.1f} us)")


if __name__ == "__main__":
    main()
