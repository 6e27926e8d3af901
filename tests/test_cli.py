"""The console scripts are installed and answer --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(("command", "sub"), [("learner", "run"), ("actors", "run"), ("proxy", "serve")])
def test_console_script_help(command: str, sub: str) -> None:
    exe = shutil.which(command, path=str(Path(sys.executable).parent))
    assert exe is not None, f"{command} is not installed next to {sys.executable}"
    top = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    assert sub in top.stdout
    nested = subprocess.run([exe, sub, "--help"], capture_output=True, text=True, timeout=60)
    assert nested.returncode == 0, nested.stderr
    assert "usage:" in nested.stdout
