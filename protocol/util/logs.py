"""One logging set-up for every command (`learner`, `actors`, `proxy`): the same flags
(`-v` / `--verbose` for debug, or `--log-level`), one line per record in one format, and
the libraries' chatter kept down.

Hugging Face's hub and datasets libraries add a handler of their own to their loggers and
let records propagate too: under our handler each of their lines (a hub retry) printed
twice, once in each format. Their handlers are removed, so they print once, in ours.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
QUIET = ("httpx", "botocore", "urllib3", "transformers", "datasets", "huggingface_hub", "filelock")
"""Libraries whose INFO lines say nothing a user acts on: WARNING and up only."""


def add_logging_flags(parser: argparse.ArgumentParser, default: str = "info") -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (= --log-level debug)")
    parser.add_argument("--log-level", choices=LEVELS, default=default, help=f"logging level (default {default})")


def level_of(args: argparse.Namespace) -> str:
    return "debug" if getattr(args, "verbose", False) else getattr(args, "log_level", "info")


def setup_logging(args: argparse.Namespace, libraries: tuple[str, ...] = ()) -> None:
    """`libraries`: those of ("huggingface_hub",) the command uses, imported here so their
    own handlers can go (the proxy uses none). The datasets library, slow to import, is
    quieted where it is imported (`own_handlers_off("datasets")`): a command must reach its
    signal handlers within a second or two of starting."""
    # before the hub is imported: it reads these once (transformers' progress bars follow its)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=level_of(args).upper(), format=FORMAT, datefmt="%H:%M:%S")
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in libraries:
        own_handlers_off(name)


def own_handlers_off(name: str) -> None:
    """The library's own handler goes (it adds it when it is first imported, so it is
    imported here first); its records reach ours."""
    try:
        importlib.import_module(f"{name}.utils.logging")  # both keep it there (the hub's package imports lazily)
    except ImportError:
        return
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
