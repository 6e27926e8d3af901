"""`actors check`: everything `actors run` with the same flags depends on, checked in
order before a worker spends GPU money. Each check prints one line; the first failure
prints what to do about it and ends the check with exit status 1.

What it touches on the queue: one status report, under `<worker-id>-check` (the only
call an actor token alone may make without taking work), and reads of the latest
adapter. Nothing is claimed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from protocol.util.checks import CheckFailed, Checks


def check(args: argparse.Namespace, engine_options: dict[str, object]) -> int:
    from actors.watcher import ProxySource
    from protocol import (
        AdapterManifest,
        QueueConfig,
        QueueForbidden,
        QueueTLSError,
        QueueUnavailable,
        StoreError,
        WorkerStatus,
        check_model_path,
        fingerprint_of_model,
        open_queue,
    )
    from protocol.usercode.rewards import RewardError, Scorer, load_reward
    from protocol.wire.errors import ProtocolError
    from protocol.wire.files import StoreMissing, verify

    checks = Checks()
    worker = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    state: dict[str, Any] = {}

    def queue() -> str:
        from actors.cli import confirm_identity

        try:
            q = open_queue(
                args.queue, QueueConfig(run=args.run or "default"), args.token, retry_s=5.0, stop=threading.Event()
            )
            try:
                args.run = confirm_identity(q, args.run)
            except ValueError as err:
                raise CheckFailed(str(err), "use the token and --run the proxy's operator gave for this run") from None
            q.report_status(WorkerStatus(worker=f"{worker}-check", engine="check", reported_at=time.time()))
        except QueueTLSError as err:
            raise CheckFailed(
                str(err),
                "give the proxy's CA certificate: SPOTGRPO_CA_CERT=cert.pem "
                "(the one `proxy selfsigned` wrote, or your CA's)",
            ) from None
        except QueueForbidden as err:
            raise CheckFailed(
                str(err), "use a token with role actor from the proxy's tokens file (--token or SPOTGRPO_TOKEN)"
            ) from None
        except QueueUnavailable as err:
            raise CheckFailed(
                str(err), f"is {args.queue} reachable from here (host, port, firewall)? Is `proxy serve` running?"
            ) from None
        except ValueError as err:
            raise CheckFailed(str(err), "--queue takes the proxy's https://proxy:port") from None
        state["queue"] = q
        return f"{args.queue} answers; this token may act as a worker" + (
            " (TLS verified)" if args.queue.startswith("https://") else ""
        )

    def run_live() -> str:
        latest = state["queue"].latest_adapter()
        state["latest"] = latest
        if latest is None:
            return (
                f"run {args.run!r}: no adapter announced yet (fine at the very start of a run; "
                "if its learner has been running a while, check --run)"
            )
        age = time.time() - latest.created_at
        return f"run {args.run!r}: adapter v{latest.version} announced, made {age:.0f}s ago"

    def model() -> str:
        try:
            check_model_path(args.model)
            ours = fingerprint_of_model(args.model)
        except (OSError, ValueError) as err:
            raise CheckFailed(
                f"--model {args.model}: {err}", "give the learner's base model: the same hub id or a copy of its folder"
            ) from None
        latest: AdapterManifest | None = state.get("latest")
        if latest is None or latest.fingerprint is None:
            return f"{args.model} loads (config, tokenizer); nothing published to compare it with yet"
        if latest.fingerprint != ours:
            raise CheckFailed(
                f"--model {args.model} is not the learner's base model {latest.base_model} (config or "
                f"tokenizer differ: {ours} against {latest.fingerprint})",
                f"start the worker with --model {latest.base_model} (or that model's files)",
            )
        return f"{args.model} matches the learner's base model {latest.base_model}"

    def rank() -> str:
        latest = state.get("latest")
        if latest is None:
            return "nothing published yet"
        if args.engine == "vllm" and latest.rank > args.max_lora_rank:
            raise CheckFailed(
                f"the learner's LoRA rank is {latest.rank}, above --max-lora-rank {args.max_lora_rank}",
                f"start the worker with --max-lora-rank {latest.rank} or more",
            )
        return f"LoRA rank {latest.rank}" + (
            f" <= --max-lora-rank {args.max_lora_rank}" if args.engine == "vllm" else ""
        )

    def rewards() -> str:
        if not args.reward:
            return "none given: fine when the learner scores on the trusted side (--scoring trusted)"
        try:
            scorer = Scorer([load_reward(spec) for spec in args.reward], timeout_s=args.reward_timeout_s)
        except RewardError as err:
            raise CheckFailed(str(err), "install the reward's package here (or put its module on PYTHONPATH)") from None
        from protocol import Prompt

        sample = scorer.score(Prompt(id="check", text="What is 1 + 1?"), "What is 1 + 1?", ["2", "3"], [[17], [18]])
        if sample.error is not None and "missing" not in sample.error and "required" not in sample.error:
            raise CheckFailed(
                f"scoring a sample failed: {sample.error}",
                "fix the reward function (it runs as in TRL: fn(prompts, completions, **columns))",
            )
        note = " (it needs data set columns, so the sample could not be scored)" if sample.error else ""
        return f"{', '.join(args.reward)} import and score a sample{note}"

    def tools() -> str:
        if not args.tools and not args.environment:
            return "none given: fine unless the learner runs --tools"
        from transformers import AutoTokenizer

        from protocol.usercode.chat import (
            ToolError,
            ToolTemplateError,
            load_episode_tools,
            tool_template,
        )

        try:
            names = [fn.__name__ for fn in load_episode_tools(args.tools or [], args.environment)[0]]
            template = tool_template(AutoTokenizer.from_pretrained(args.model))
        except ToolError as err:
            raise CheckFailed(
                str(err),
                "install the tool's package here (or put its module on PYTHONPATH); a tool "
                "is a typed function whose docstring documents every argument",
            ) from None
        except ToolTemplateError as err:
            raise CheckFailed(str(err), "use the learner's --model") from None
        offered = "the model's chat template" if template is None else "the ChatML tool template"
        return f"{', '.join(names)} import and describe themselves; calls are read with {offered}'s format"

    def download() -> str:
        """The newest version now (a fast learner prunes old ones while the checks before
        this ran), again if it is pruned mid-download."""
        q = state["queue"]
        source = ProxySource(q)
        folder = Path(tempfile.mkdtemp(prefix="spotgrpo-check-"))
        latest: AdapterManifest | None = None
        for _ in range(3):
            newest = q.latest_adapter()
            if newest is None:
                return "nothing published yet"
            if latest is not None and newest.version == latest.version:
                raise CheckFailed(
                    f"adapter v{latest.version} is announced but not in the store",
                    "the learner's store lost it: check the learner's log and --store",
                ) from None
            latest = newest
            try:
                size = 0
                for entry in latest.files:
                    data = source.fetch(latest, entry.name)
                    verify(entry, data)
                    (folder / entry.name).write_bytes(data)
                    size += len(data)
                state["adapter"] = (latest.version, folder)
                return f"adapter v{latest.version} downloaded and verified ({size / 1e6:.1f} MB)"
            except StoreMissing:  # pruned while it was read: a newer one is announced
                continue
            except (StoreError, ProtocolError, OSError) as err:
                shutil.rmtree(folder, ignore_errors=True)
                raise CheckFailed(
                    f"adapter v{latest.version}: {err}",
                    "the download URLs must be reachable from here: the proxy's --presign-endpoint "
                    "names the bucket's public address (compose: PRESIGN_ENDPOINT)",
                ) from None
        shutil.rmtree(folder, ignore_errors=True)
        raise CheckFailed(
            "each newest adapter was pruned before it could be downloaded",
            "the learner publishes faster than this machine downloads: raise its --keep-adapters",
        )

    def engine() -> str:
        if args.skip_engine:
            return "skipped (--skip-engine)"
        from actors.engine import EngineError, open_engine

        try:
            eng = open_engine(args.engine, args.model, **engine_options)
        except (EngineError, OSError, ValueError, RuntimeError) as err:
            raise CheckFailed(
                f"the {args.engine} engine cannot load {args.model}: {err}",
                "check the GPU (nvidia-smi), --gpu-memory-utilization and --max-model-len",
            ) from None
        try:
            if "adapter" in state:
                version, folder = state["adapter"]
                try:
                    eng.load_adapter(version, folder)
                except EngineError as err:
                    raise CheckFailed(str(err), "the adapter does not fit this engine: see --max-lora-rank") from None
                return f"{args.engine} engine loaded {args.model} and adapter v{version}"
            return f"{args.engine} engine loaded {args.model}"
        finally:
            eng.close()

    try:
        return checks.run_all(
            [
                ("queue", queue),
                ("run", run_live),
                ("model", model),
                ("rank", rank),
                ("rewards", rewards),
                ("tools", tools),
                ("download", download),
                ("engine", engine),
            ],
            "`actors run` with these flags is ready",
        )
    finally:
        if "queue" in state:
            state["queue"].close()
        if "adapter" in state:
            shutil.rmtree(state["adapter"][1], ignore_errors=True)
