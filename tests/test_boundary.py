"""The trust boundary as `make lint` checks it: DESIGN.md's import rules are import-linter
contracts in pyproject.toml. They hold on the code, and an import that crosses one fails
the check with the chain that crosses it (tried on a copy of the packages)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache", "--no-logo"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for part in ("protocol", "learner", "actors", "proxy"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def _add(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_contracts_hold_and_each_crossing_fails_them(copy: Path) -> None:
    ok = _lint(copy)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "5 kept, 0 broken" in ok.stdout
    crossings = [
        ("actors.worker", "import redis", "actors.worker -> redis"),  # a worker with a Redis client
        ("actors.watcher", "from protocol.trusted.store import open_store", "actors.watcher -> protocol.trusted"),
        ("protocol.client.http_queue", "import boto3", "protocol.client.http_queue -> boto3"),
        ("proxy.app", "from learner import loop", "proxy.app -> learner.loop"),  # parts meet on the wire only
        ("protocol.wire.codec", "import httpx", "protocol.wire.codec -> httpx"),
        ("learner.loop", "import rq", "learner.loop -> rq"),  # only the tier and protocol.trusted
        ("protocol.usercode.rewards", "from actors import worker", "protocol.usercode.rewards -> actors.worker"),
    ]
    for module, line, chain in crossings:
        path = copy / (module.replace(".", "/") + ".py")
        before = path.read_text()
        _add(copy, module, line)
        try:
            broken = _lint(copy)
        finally:
            path.write_text(before)
        assert broken.returncode == 1, (line, broken.stdout)
        assert chain in broken.stdout, (line, broken.stdout[-3000:])
