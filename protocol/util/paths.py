"""Paths a user types on a command line."""

from __future__ import annotations

import os
from pathlib import Path


def check_model_path(spec: str) -> None:
    """Raise a plain "no such directory" for a `--model` that names a local path that is
    not there, instead of the hub client's complaint about repository ids. A hub id is
    `name` or `org/name`; anything starting with `/`, `.` or `~`, or with more than one
    `/`, is a path."""
    looks_local = spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)
    if looks_local and not Path(spec).expanduser().is_dir():
        raise FileNotFoundError(f"--model {spec}: no such directory")
