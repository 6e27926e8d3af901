"""The `actors` command: rollout workers.

`actors run --queue https://proxy:8443 --token … --engine vllm --model …`: one rollout
worker. Start as many as you like; SIGTERM hands the batch in hand back and exits 0.
With `--reward mod:fn` it also scores, for a learner that runs `--scoring actors`.
Without `--run`, a worker whose token names several runs serves them all on one engine,
each run's adapters its own, claiming by each run's weighted share (`actors.runs`).

A worker reaches its run only through `proxy serve`, with an actor token: it holds no
Redis or bucket credentials and imports neither client. The trusted scoring tier is
`learner score`, on the trusted side; `actors score` only says so.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from pathlib import Path

from protocol.util.config_file import apply_config_file, config_flag, subcommand
from protocol.util.logs import add_logging_flags

log = logging.getLogger("actors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actors", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_worker_flags(sub.add_parser("run", help="Start one rollout worker.", description=__doc__.split("\n\n")[1]))
    check = sub.add_parser(
        "check",
        help="Check, before spending GPU time, that `actors run` with these flags would work.",
        description=CHECK_HELP,
    )
    add_worker_flags(check)
    check.add_argument("--skip-engine", action="store_true", help="do not load the engine (the slowest check)")
    # the trusted tier's command lives with the trusted side: this name for it only says so
    sub.add_parser("score", help="moved: the trusted scoring tier is `learner score`.", description=MOVED_SCORE)
    return parser


MOVED_SCORE = (
    "the trusted scoring tier is `learner score` (same flags), run on the trusted side beside the "
    "run's Redis: a worker's package holds no Redis client"
)


CHECK_HELP = """Run every check `actors run` with the same flags depends on, before a worker spends
GPU money: the token and its role, TLS against the given CA, the run (an adapter
announced), the model against the learner's (config and tokenizer fingerprint), the LoRA
rank against --max-lora-rank, the rewards (when given), an adapter download from here,
and the engine loading it. Prints a line per check; exits 0, or 1 at the first failure
with what to do about it."""


def add_worker_flags(run: argparse.ArgumentParser) -> None:
    config_flag(run, "actors")
    a = run.add_argument
    a("--queue", required=True, help="the proxy: https://proxy:port (with --token); adapters download through it")
    a("--token", default=os.environ.get("SPOTGRPO_TOKEN"), help="the proxy's actor token (or SPOTGRPO_TOKEN)")
    a(
        "--run",
        default=None,
        help="run name: the learner's --run (default: every run the token names, on one engine, or the run the "
        "proxy serves; a --run the token may not touch is refused)",
    )
    a(
        "--find-runs-every-s",
        type=float,
        default=60.0,
        help="without --run: how often to ask the proxy for runs newly given to the token (default 60)",
    )
    a("--engine", choices=["transformers", "vllm"], default="transformers", help="inference engine")
    a("--model", required=True, help="base model: Hugging Face id or local path (the learner's --model)")
    a(
        "--reward",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION[=WEIGHT]",
        help="reward function with TRL's signature; repeat for several (weighted sum). Needed only when the "
        "learner runs --scoring actors; with trusted scoring the worker only generates",
    )
    a(
        "--reward-timeout-s",
        type=float,
        default=60.0,
        help="time limit per reward call (default 60); past it the scoring process is killed and replaced",
    )
    a(
        "--reward-workers",
        type=int,
        default=1,
        help=(
            "processes scoring beside the engine (default 1; 0: score in the worker, where a hung reward cannot be "
            "killed)"
        ),
    )
    a(
        "--tools",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION",
        help="a tool episodes may call (TRL's tools=[...]: a typed, documented function, sync or async); repeat for "
        "several. Needed when the learner runs --tools: the same functions",
    )
    a(
        "--environment",
        default=None,
        metavar="MODULE:CLASS",
        help="stateful episodes (TRL's environment_factory): one instance per episode, its public methods are tools. "
        "Needed when the learner runs --environment: the same class",
    )
    a(
        "--tool-timeout-s",
        type=float,
        default=10.0,
        help="time limit per tool call (default 10); past it the call's process is killed and the model told so",
    )
    a(
        "--tool-memory-mb",
        type=int,
        default=2048,
        help="address-space limit of each tool process (default 2048); a call past it fails and the model is told so",
    )
    a(
        "--tool-workers",
        type=int,
        default=8,
        help="processes running tool calls beside the engine, and hosts of --environment instances (default 8): "
        "calls in flight past this wait, so an I/O-bound tool wants one per call in flight",
    )
    a("--worker-id", default=None, help="consumer name (default host-pid-random)")
    a("--keep-adapters", type=int, default=2, help="adapter versions kept loaded (default 2)")
    a(
        "--in-flight-updates",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a generation running when a newer adapter is loaded goes on with it from its prefix, each token keeping "
        "its version and log-probability (default); --no-in-flight-updates: each group on the version it started with",
    )
    a("--cache-dir", type=Path, default=None, help="where downloaded adapters go (default a temp dir)")
    a(
        "--adapter-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="a folder the workers of this machine share: each adapter file is fetched once per machine and "
        "hard-linked into each worker's --cache-dir (default: none, each worker fetches its own)",
    )
    a(
        "--adapter-cache-mb",
        type=float,
        default=4096.0,
        help="--adapter-cache's size; the least recently used files go first (default 4096)",
    )
    a(
        "--lease-timeout-s",
        type=float,
        default=None,
        help="redis:// queue: a lease not heartbeated for this long is taken over (default 60); "
        "through a proxy its own --lease-timeout-s counts, and heartbeats follow it",
    )
    a("--claim-block-s", type=float, default=5.0, help="long-poll wait for a batch (default 5)")
    a(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="give up (one line, exit 1) when the queue stays unreachable this long at start-up (default 300)",
    )
    a(
        "--grace-s",
        type=float,
        default=0.0,
        help="on SIGTERM, let the batch in hand finish for this long before handing it back (default 0: at once)",
    )
    a("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    a(
        "--report-every-s",
        type=float,
        default=10.0,
        help=(
            "report this worker's status (adapter loaded, last error, throughput) on the queue this often (default 10)"
        ),
    )
    a(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="model dtype (default: float32 for transformers, auto for vllm)",
    )
    a(
        "--max-num-seqs",
        type=int,
        default=None,
        help="sequences kept in the engine at once, across leases (default: vLLM's scheduler limit for the GPU; "
        "transformers: --max-batch-sequences)",
    )
    a("--max-batch-sequences", type=int, default=64, help="transformers engine: sequences per generate call")
    a("--tensor-parallel-size", type=int, default=1, help="vllm engine: GPUs one model is split across")
    a(
        "--gpus",
        default=None,
        metavar="0,1,...",
        help="start one worker per listed GPU (CUDA_VISIBLE_DEVICES), each with these flags; SIGTERM reaches all",
    )
    a("--max-lora-rank", type=int, default=64, help="vllm engine: largest LoRA rank to serve")
    a("--max-model-len", type=int, default=None, help="vllm engine: context length")
    a("--gpu-memory-utilization", type=float, default=0.9, help="vllm engine: GPU memory fraction")
    add_logging_flags(run)


def confirm_identity(queue: object, run: str | None) -> str:
    """Through a proxy: the token must be an actor's and `run` (if given) the proxy's run.
    Returns the run. Raises ValueError with what to change."""
    from protocol.client.http_queue import confirm_identity as confirm

    return confirm(queue, "actor", run, "a rollout worker")


def say_lease_timeout(timeout_s: float, asked_s: float | None) -> None:
    """One line on the lease timeout in force; a warning where `--lease-timeout-s` was given
    and the proxy's differs (the proxy's counts, and the heartbeats follow it)."""
    if asked_s is not None and asked_s != timeout_s:
        log.warning(
            "--lease-timeout-s %g: the proxy's lease timeout, %g s, counts; heartbeats follow it", asked_s, timeout_s
        )
    from actors.heartbeat import heartbeat_period_s

    log.info("lease timeout %g s: a heartbeat every %g s", timeout_s, heartbeat_period_s(timeout_s))


def engine_options(args: argparse.Namespace, runs: int = 1) -> dict[str, object]:
    if args.engine == "transformers":
        return {"dtype": args.dtype or "float32", "max_batch_sequences": args.max_batch_sequences}
    return {
        "dtype": args.dtype or "auto",
        "max_lora_rank": args.max_lora_rank,
        # LoRAs in one batch: each run's kept versions, and one evicted while its last requests finish
        "max_loras": (args.keep_adapters + 1) * runs,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        "tensor_parallel_size": args.tensor_parallel_size,
    }


def run(args: argparse.Namespace) -> int:
    from actors.engine import Engine, EngineError, open_engine
    from actors.episodes import EpisodeEngine
    from actors.metrics import WorkerMetrics
    from actors.node_cache import NodeCache
    from actors.rewards import ScoringPool
    from actors.runs import RunOpener, our_fingerprint, serving_runs
    from actors.tools import Toolbox
    from actors.watcher import AdapterWatcher, ProxySource
    from actors.worker import Scoring, Worker, WorkerEngineDead, WorkerRefused
    from protocol import (
        AdapterManifest,
        Queue,
        QueueConfig,
        QueueError,
        QueueRefused,
        QueueUnavailable,
        check_model_path,
        connect_queue,
    )
    from protocol.usercode.chat import ToolTemplateError, say_template, tool_template
    from protocol.usercode.rewards import RewardError, Scorer, load_reward

    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    stopping = threading.Event()
    worker: Worker | None = None

    def stop(signum: int, _frame: object) -> None:
        log.warning("%s: no more claims; handing back or finishing the batch in hand", signal.Signals(signum).name)
        stopping.set()
        if worker is not None:
            worker.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        check_model_path(args.model)
        scorer: Scoring | None = (
            None
            if not args.reward
            else ScoringPool(args.reward, args.reward_timeout_s, workers=args.reward_workers)
            if args.reward_workers > 0
            else Scorer([load_reward(spec) for spec in args.reward], timeout_s=args.reward_timeout_s)
        )
        toolbox = (
            Toolbox(
                args.tools or [],
                environment=args.environment,
                timeout_s=args.tool_timeout_s,
                memory_mb=args.tool_memory_mb,
                workers=args.tool_workers,
            )
            if args.tools or args.environment
            else None
        )
        config = QueueConfig(
            run=args.run or "default", lease_timeout_s=60.0 if args.lease_timeout_s is None else args.lease_timeout_s
        )
        queue = connect_queue(args.queue, config, args.token, args.startup_timeout_s, stopping)
        asked = args.run
        args.run = confirm_identity(queue, args.run)  # before the model loads: a wrong token costs nothing
        runs, patterns = serving_runs(queue, asked)
        if not runs:
            log.info("no run matching %s has started yet: waiting for one", ", ".join(patterns))
        while not runs and not stopping.wait(args.find_runs_every_s):
            runs, patterns = serving_runs(queue, asked)
        if not runs:
            return 0  # stopped while waiting
        say_lease_timeout(queue.config.lease_timeout_s, args.lease_timeout_s)
        source = ProxySource(queue)  # presigned downloads: no bucket credentials here
    except (RewardError, ValueError, FileNotFoundError, QueueRefused) as err:
        print(f"actors run: {err}", file=sys.stderr)
        return 2
    except QueueUnavailable as err:
        print(f"actors run: {err}", file=sys.stderr)
        return 1
    metrics = WorkerMetrics()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port)
    try:
        engine = open_engine(args.engine, args.model, **engine_options(args, len(runs)))
    except (EngineError, OSError, ValueError) as err:
        print(f"actors run: cannot load {args.model}: {err}", file=sys.stderr)
        return 2
    if toolbox is not None:
        try:
            template = tool_template(engine.tokenizer)
        except ToolTemplateError as err:
            print(f"actors run: --tools: {err}", file=sys.stderr)
            engine.close()
            toolbox.close()
            return 2
        say_template(template)
        engine = EpisodeEngine(engine, toolbox, template)
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="spotgrpo-adapters-"))

    def loaded(manifest: AdapterManifest, seconds: float) -> None:
        metrics.adapter_version.set(manifest.version)
        metrics.adapter_load.observe(seconds)

    node_cache = NodeCache(args.adapter_cache, args.adapter_cache_mb) if args.adapter_cache else None

    def watcher_for(run_queue: Queue, run_engine: Engine, folder: Path) -> AdapterWatcher:
        return AdapterWatcher(
            run_queue,
            source if run_queue is queue else ProxySource(run_queue),
            run_engine,
            folder,
            keep_adapters=args.keep_adapters,
            on_loaded=loaded,
            on_refused=lambda v, reason: metrics.adapters_refused.inc(),
            node_cache=node_cache,
        )

    # without --run: every run the token names, now and as runs are added (the proxy asked again each minute)
    opener = RunOpener(queue, engine, watcher_for, cache) if asked is None else None
    links = [opener.open(run) for run in runs] if opener is not None else []
    watcher = links[0].watcher if links else watcher_for(queue, engine, cache)
    worker = Worker(
        links[0].queue if links else queue,
        engine,
        watcher,
        scorer,
        worker_id,
        claim_block_s=args.claim_block_s,
        grace_s=args.grace_s,
        max_num_seqs=args.max_num_seqs,
        metrics=metrics,
        report_every_s=args.report_every_s,
        more_runs=links[1:],
        fingerprint=our_fingerprint(args.model),
        find_runs=opener.new_runs if opener is not None else None,
        find_runs_every_s=args.find_runs_every_s,
        keep_serving=bool(patterns),
        in_flight_updates=args.in_flight_updates,
    )
    if stopping.is_set():  # a signal came while the engine loaded
        worker.stop()
    try:
        if opener is None:
            try:
                watcher.sync()  # start on the newest adapter rather than the base model
            except QueueError as err:
                log.warning("no adapter announcements yet (%s); the watcher keeps trying", err)
            watcher.start()
        log.info("worker %s: %s engine on %s, runs %s", worker_id, args.engine, args.model, ", ".join(runs))
        code = worker.work()
        if worker.run_over is not None:
            print(f"actors run: {worker.run_over}", file=sys.stderr)
        return code
    except WorkerRefused as err:
        print(f"actors run: {err}", file=sys.stderr)
        return 2
    except WorkerEngineDead as err:
        print(f"actors run: {err}; its leases were handed back", file=sys.stderr)
        return 3
    finally:
        if opener is not None:
            opener.close()
        else:
            watcher.close()
        if scorer is not None:
            scorer.close()
        engine.close()
        queue.close()


def run_per_gpu(args: argparse.Namespace, argv: list[str]) -> int:
    """`--gpus 0,1,2,3`: one `actors run` per GPU, each seeing only its own
    (CUDA_VISIBLE_DEVICES) and named `<worker-id>-gpu<N>`, the i-th serving its metrics on
    `--metrics-port` + i; SIGTERM and SIGINT are passed on to all; the exit status is the
    worst of theirs."""
    import subprocess

    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus):
        print(f"actors run: --gpus {args.gpus!r}: expected GPU numbers like 0,1,2,3", file=sys.stderr)
        return 2
    rest, skip = [], False
    for arg in argv:  # the same flags, without --gpus and --worker-id (set per GPU below)
        if skip:
            skip = False
        elif arg in ("--gpus", "--worker-id", "--metrics-port"):
            skip = True
        elif not arg.startswith(("--gpus=", "--worker-id=", "--metrics-port=")):
            rest.append(arg)
    base = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "actors.cli",
                *rest,
                "--worker-id",
                f"{base}-gpu{g}",
                *([] if args.metrics_port is None else ["--metrics-port", str(args.metrics_port + i)]),
            ],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": g},
        )
        for i, g in enumerate(gpus)
    ]

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(child.wait() for child in children)


def main(argv: list[str] | None = None) -> int:
    from protocol.usercode.rewards import working_folder_on_path

    working_folder_on_path()  # user code (--reward, --tools, --environment) imports from here
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["score"]:  # whatever its flags: the command is not here
        print(f"actors score: {MOVED_SCORE}", file=sys.stderr)
        return 2
    fill = (  # the run's config file: what workers share with the learner, and [actors]
        apply_config_file(subcommand(parser, argv[0]), argv[1:], "actors") if argv[:1] in (["run"], ["check"]) else None
    )
    args = parser.parse_args(argv)
    if fill is not None:
        fill(args)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "run" and args.gpus is not None:
        return run_per_gpu(args, argv)
    from protocol.util.lifeline import follow_lifeline
    from protocol.util.logs import setup_logging

    setup_logging(args, libraries=("huggingface_hub",))
    follow_lifeline()  # started by the embedded default: end with it
    if args.command == "check":
        from actors.check import check

        return check(args, engine_options(args))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
