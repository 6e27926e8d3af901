"""`learner score`: one worker of the trusted scoring tier (`learner.scoring.tier`), on the
trusted side beside the learner: it reads the run's Redis and the data set's private
columns, which no rollout worker ever holds. (`actors score` is the same command under
its earlier name.)"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from protocol.util.config_file import config_flag
from protocol.util.logs import add_logging_flags

log = logging.getLogger("learner.score")


def add_score_flags(score: argparse.ArgumentParser) -> None:
    a = score.add_argument
    a(
        "--queue",
        "--redis",
        dest="redis",
        required=True,
        metavar="URL",
        help="redis://host:port/db of the run, the learner's --queue (the trusted side reaches Redis itself; "
        "--redis is the same flag)",
    )
    a(
        "--rq-redis",
        metavar="URL",
        default=None,
        help="a plain Redis for RQ's jobs (default: the run's); needed where --queue is a Redis Cluster, whose "
        "hash slots RQ's transactions cannot span",
    )
    a("--run", default="default", help="run name (the learner's --run)")
    a(
        "--model",
        required=True,
        help="the learner's --model (a path or hub id; only its tokenizer is loaded): the tier decodes each "
        "completion's token ids with it and scores that text, the text the learner trains on",
    )
    a(
        "--reward",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION[=WEIGHT]",
        help="reward function with TRL's signature (may be async def); repeat for several (weighted sum)",
    )
    a(
        "--environment",
        default=None,
        metavar="MODULE:CLASS",
        help="the learner's --environment, when it owns a reward (get_reward): each episode is replayed in a fresh "
        "instance with every column and its get_reward() added, weight 1 (it may stand without --reward)",
    )
    a(
        "--tools",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION",
        help="the learner's --tools, when its batches offer tools: they are not run here, but the run's tokenizer is "
        "then loaded once, to check each episode's mask against its model turns (else in each job that meets one)",
    )
    a(
        "--tool-timeout-s",
        type=float,
        default=10.0,
        help="the environment's replay: time limit per call, reset and get_reward included (default 10, the actors'); "
        "past it the group is rejected with that reason",
    )
    a(
        "--tool-memory-mb",
        type=int,
        default=2048,
        help="the environment's replay: address space it may add (default 2048); past it the group is rejected",
    )
    a(
        "--reward-timeout-s",
        type=float,
        default=60.0,
        help="time limit per group (default 60): a group whose rewards run longer is rejected with that reason, "
        "not retried, and the job goes on with the lease's other groups",
    )
    a("--retries", type=int, default=2, help="re-runs of a group whose reward raised (default 2), with backoff")
    a("--retry-backoff-s", type=float, default=1.0, help="first retry after this, doubling (default 1)")
    a(
        "--abandon-after-s",
        type=int,
        default=60,
        help="a job whose worker stopped heartbeating this long is abandoned and retried by another (default 60)",
    )
    a("--monitoring-interval-s", type=int, default=10, help="worker heartbeat while a job runs (default 10)")
    a("--maintenance-interval-s", type=int, default=30, help="how often RQ's registries are cleaned (default 30)")
    a(
        "--groups-per-job",
        type=int,
        default=32,
        help=(
            "most groups scored in one RQ job, from one lease or several read together (default 32; 1: a job per group)"
        ),
    )
    a(
        "--reward-batch",
        action="store_true",
        help=(
            "call each reward function once per job, on all its groups' completions together (TRL's batch: a reward "
            "model or an LLM judge batches its work); if that call fails, each group is scored alone"
        ),
    )
    a(
        "--redispatch-s",
        type=float,
        default=30.0,
        help="a group read by a dispatcher that made no job of it for this long is dispatched again (default 30)",
    )
    a(
        "--name",
        default=None,
        help="worker name within the run (default scorer-<host>-<pid>, with a suffix if a worker of the run holds it); "
        "a name held by a live worker of the run is refused",
    )
    a("--burst", action="store_true", help="exit when the queue is empty (for tests and batch jobs)")
    config_flag(score, "score")
    add_logging_flags(score)


SCORE_HELP = """Start one scoring worker of the trusted tier: an RQ worker (a work horse forked
per job of up to --groups-per-job groups) and a dispatcher that turns submitted groups into RQ jobs. It scores groups of
batches the learner issued with --scoring trusted, with the data set's private columns,
which never leave the trusted side. Start as many as you like; SIGTERM stops one warmly
(the group in hand finishes), and a killed one's job is retried by another."""


def score(args: argparse.Namespace, prog: str = "learner score") -> int:
    from learner.detokenize import load_decode, load_tokenizer
    from learner.scoring.episodes import EpisodeReader
    from learner.scoring.replay import ReplayLimits
    from learner.scoring.reward_host import HostedScorer
    from learner.scoring.tier import NameTaken, free_name, serve
    from protocol import QueueConfig, QueueUnavailable, check_model_path
    from protocol.trusted.scoring import ScoringQueue
    from protocol.usercode.rewards import RewardError, load_reward
    from protocol.usercode.transcript import environment_reward

    if not args.redis.startswith(("redis://", "rediss://", "unix://")):
        print(
            f"{prog}: --queue {args.redis!r}: expected redis://, rediss:// or unix:// "
            "(scoring runs on the trusted side, on the run's Redis itself, never through the proxy)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer is used in forked work horses
    try:
        check_model_path(args.model)
        # episodes need transformers' tokenizer (loaded here, once, where the run offers tools or an
        # environment; else on the first episode in a work horse); plain scoring only decodes
        tokenizer = load_tokenizer(args.model) if args.environment or args.tools else None
        decode = load_decode(args.model, tokenizer)
        environment = environment_reward(args.environment, tokenizer) if args.environment else None
        # loaded here too: a bad spec is refused before anything starts; they run in the reward host
        scorer = HostedScorer(
            [load_reward(spec) for spec in args.reward or []],
            list(args.reward or []),
            extra=environment.name if environment else None,
        )
        queue = ScoringQueue.from_url(args.redis, QueueConfig(run=args.run), rq_url=args.rq_redis)
    except (RewardError, ValueError, OSError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    except QueueUnavailable as err:
        print(f"{prog}: --queue {args.redis}: {err}", file=sys.stderr)
        return 1
    check = RewardsCheck(queue, args.reward or [], args.run, prog, args.environment)
    try:
        name = free_name(
            queue, args.name or f"scorer-{socket.gethostname()}-{os.getpid()}", chosen=args.name is not None
        )
        if check.disagrees():  # the learner has said its rewards: they must be these
            raise RewardsDiffer(check.line.removeprefix(f"{prog}: "))
    except (NameTaken, RewardsDiffer) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        queue.close()
        return 2
    except QueueUnavailable as err:
        print(f"{prog}: --queue {args.redis}: {err}", file=sys.stderr)
        queue.close()
        return 1
    if check.pending:  # said when the learner starts: checked then
        check.start()
    log.info(
        "scoring worker %s for run %s: %s",
        name,
        args.run,
        ", ".join([*(args.reward or []), *([args.environment] if args.environment else [])]),
    )

    try:
        serve(
            queue,
            scorer,
            name,
            decode=decode,
            job_timeout_s=args.reward_timeout_s,
            retries=args.retries,
            retry_backoff_s=args.retry_backoff_s,
            groups_per_job=args.groups_per_job,
            reward_batch=args.reward_batch,
            abandon_after_s=args.abandon_after_s,
            monitoring_interval_s=args.monitoring_interval_s,
            maintenance_interval_s=args.maintenance_interval_s,
            redispatch_s=args.redispatch_s,
            burst=args.burst,
            environment=environment,
            episodes=EpisodeReader(args.model, tokenizer),
            replay_limits=ReplayLimits(args.tool_timeout_s, args.tool_memory_mb),
        )
    except QueueUnavailable as err:
        print(f"{prog}: --queue {args.redis}: {err}", file=sys.stderr)
        return 1
    finally:
        check.stop.set()
        queue.close()
    if check.line:
        print(check.line, file=sys.stderr)
        return 2
    return 0


class RewardsDiffer(ValueError):
    """A scoring worker's rewards are not those the run's learner scores with."""


class RewardsCheck:
    """A scoring worker's rewards against those the run's learner said it scores with
    (`Queue.set_run_rewards`, at its start): the same functions and weights, however
    written, or the worker refuses. Until the learner has said, a thread asks again (with
    backoff: nothing is issued, so nothing is scored, before it says) and stops the worker
    warmly (SIGTERM) if they differ."""

    def __init__(self, queue: Any, specs: list[str], run: str, prog: str, environment: str | None = None) -> None:
        from protocol.usercode.rewards import canonical_spec

        self.queue, self.run, self.prog = queue, run, prog
        self.mine = sorted(canonical_spec(s) for s in specs)
        self.environment = environment
        self.pending = True
        self.line = ""
        self.stop = threading.Event()

    def disagrees(self) -> bool:
        from protocol.usercode.rewards import ENVIRONMENT

        theirs = self.queue.run_rewards()
        if theirs is None:
            return False
        self.pending = False
        functions = sorted(s for s in theirs if not s.startswith(ENVIRONMENT))
        environment = next((s.removeprefix(ENVIRONMENT) for s in theirs if s.startswith(ENVIRONMENT)), None)
        if functions != self.mine:
            self.line = (
                f"{self.prog}: its rewards ({', '.join(self.mine) or 'none'}) differ from those run {self.run!r}'s "
                f"learner scores with ({', '.join(functions) or 'none'}): start it with the learner's config "
                "(`learner score --config grpo.toml`) or the same --reward flags"
            )
            return True
        if environment is not None and environment != self.environment:
            self.line = (
                f"{self.prog}: run {self.run!r}'s learner scores episodes with environment {environment}'s get_reward, "
                f"this worker {'with ' + self.environment if self.environment else 'without one'}: start it with the "
                f"learner's config (`learner score --config grpo.toml`) or --environment {environment}"
            )
            return True
        return False

    def start(self) -> None:
        threading.Thread(target=self._wait, name="rewards-check", daemon=True).start()

    def _wait(self) -> None:
        from protocol import QueueError
        from protocol.util.retry import Backoff

        backoff = Backoff(first=0.5, cap=5.0)
        while not backoff.wait(self.stop):
            try:
                if self.disagrees():  # said when the worker has stopped
                    os.kill(os.getpid(), signal.SIGTERM)  # RQ's warm shutdown: the job in hand finishes
                    return
            except QueueError as err:
                log.debug("could not read the run's rewards yet: %s", err)
            if not self.pending:
                return
