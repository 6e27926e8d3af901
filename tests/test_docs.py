"""The README and docs/ say what works: every command line they show parses with the
command's own parser, every page they link exists, and the README's quick start for TRL
users runs as written (on the tiny model)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks(text: str, language: str | None = None) -> list[str]:
    """The fenced code blocks of a page (of one language, if given)."""
    return [
        m.group(2)
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
        if language is None or m.group(1) == language
    ]


def _command_lines(text: str) -> list[list[str]]:
    """`learner …`, `actors …` and `proxy …` lines of the code blocks, continuations joined,
    comments and shell prefixes (`make … &&`, `.venv/bin/`, `VAR=value`) taken off."""
    out = []
    for block in _blocks(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"^.*&&\s*", "", line.split(" #", 1)[0].strip())
            first = [w for w in line.split() if not re.match(r"^[A-Z_]+=", w)][:1]
            if not first or first[0].removeprefix(".venv/bin/") not in ("learner", "actors", "proxy"):
                continue
            words = shlex.split(line, comments=True)
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words and words[0].removeprefix(".venv/bin/") in ("learner", "actors", "proxy"):
                out.append([words[0].removeprefix(".venv/bin/"), *words[1:]])
    return out


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from actors.cli import build_parser as actors
    from learner.cli import build_parser as learner
    from proxy.cli import build_parser as proxy

    return {"learner": learner(), "actors": actors(), "proxy": proxy()}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_a_page_shows_parses(page: Path) -> None:
    parsers = _parsers()
    lines = _command_lines(page.read_text())
    for words in lines:
        try:
            parsers[words[0]].parse_args(words[1:])
        except SystemExit as exit_:
            pytest.fail(f"{page.name}: `{shlex.join(words)}` does not parse (exit {exit_.code})")


def test_the_pages_show_commands_and_link_pages_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(_command_lines(readme)) >= 3
    links = re.findall(r"\]\((docs/[\w.-]+\.md)\)", readme)
    assert len(set(links)) >= 6
    for link in links:
        assert (REPO / link).is_file(), link
    for page in PAGES[1:]:
        for link in re.findall(r"\]\((\.\./[\w./-]+)\)", page.read_text()):
            assert (page.parent / link).resolve().exists(), (page.name, link)


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path: Path, tiny_model: Path) -> None:
    """The TRL user's files from the README, as they are (the model swapped for the tiny one
    and the run cut to 3 steps), and its command: a run that trains, under TRL's names."""
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Your own run, in TRL's terms", 1)[1].split("\n## ", 1)[0]
    (toml,), (row,), (reward,) = _blocks(quick, "toml"), _blocks(quick, "json"), _blocks(quick, "python")
    toml = re.sub(r"(?m)^model = .*$", f'model = "{tiny_model}"', toml)
    toml = re.sub(r"(?m)^max_steps = .*$", "max_steps = 3", toml)
    toml = re.sub(r"(?m)^max_completion_length = .*$", "max_completion_length = 4", toml)
    (tmp_path / "grpo.toml").write_text(toml)
    example = json.loads(row)
    (tmp_path / "data.jsonl").write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": str(a + b)}) + "\n"
            for a in range(10)
            for b in range(10)
        )
    )
    assert set(example) == {"prompt", "answer"}
    (tmp_path / "my_rewards.py").write_text(reward)
    (command,) = [c for c in _command_lines(quick) if c[:2] == ["learner", "run"]]
    exe = Path(sys.executable).parent / "learner"
    done = subprocess.run([str(exe), *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("rewards/correct/mean" in r and "completions/mean_length" in r for r in rows)
    from learner.embedded import redis_server_binary

    own_redis = ["redis.log"] if redis_server_binary("auto") else []  # a redis-server where installed
    assert sorted(p.name for p in (tmp_path / "runs" / "default" / "logs").iterdir()) == sorted(
        ["actor-0.log", "actor-1.log", "proxy.log", "scorer-0.log", *own_redis]
    )
