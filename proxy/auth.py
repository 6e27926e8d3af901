"""Bearer tokens with one role each, from a TOML file or an environment variable.

    [[tokens]]
    name = "spot-fleet-a"   # shows up in logs and metrics instead of the secret
    role = "actor"          # actor | learner | admin
    secret = "..."          # at least 32 characters
    workers = 1000          # optional, actors: a fleet of this many workers (sizes its caps)
    runs = ["exp-a", "exp-b"]  # optional: the runs it may touch (a learner's: one); none: --run's
    # an actor's or admin's may end in *: "sweep-*" is every run so named that a learner started

A proxy serves its `--run` and every run a token names, each with its own keys on Redis
and, where `--store` holds `{run}`, its own prefix in the store. A request names its run
in the `Spotgrpo-Run` header (`protocol.client.http.RUN_HEADER`); without one it is the token's run: `--run`
where the token may touch it, else the one run the token names. SIGHUP reads the file
again (`proxy.context.Context.reload_tokens`). A run pattern (`"sweep-*"`, `"*"`) matches
the runs registered on the proxy's Redis (`protocol.wire.keys.RUNS_KEY`: each run whose
learner started it and has not finished it), so a fleet serves a new run of its team
from its learner's first call, with no edit of the tokens. A learner token names its one
run; a name a pattern matches but no learner started is refused (the proxy keeps no
context for runs nobody started).

The variable `SPOTGRPO_TOKENS` holds the same TOML text. Secrets are compared in
constant time against every known token and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["actor", "learner", "admin"]

ROLES: tuple[Role, ...] = ("actor", "learner", "admin")
MIN_SECRET = 32
MAX_WORKERS = 100_000
MAX_RUNS = 1000
"""Most runs one token may name (`WhoAmIResponse.runs` lists them)."""
PLACEHOLDER = "REPLACE-"
"""How `proxy/tokens.example.toml`'s secrets begin: refused, so a copied example never serves."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_PATTERN = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,62})?\*$")


class TokenError(ValueError):
    """The tokens file is invalid."""


class RunRefused(Exception):
    """The token may not touch the run a request names, or names none and has several."""


@dataclass(frozen=True)
class Token:
    name: str
    role: Role
    digest: bytes
    """sha256 of the secret: what is compared, so secrets of any length compare in the same time."""
    workers: int | None = None
    """A fleet's token: the workers it is for. Its caps (event streams, long-polls, live
    workers, requests/s, body bytes) are sized for them (`proxy.context.ProxyLimits.caps`)
    in place of the proxy's per-token flags, so a stolen copy holds no more than that fleet does."""
    runs: frozenset[str] | None = None
    """The runs it may touch, by name or pattern (`"sweep-*"`); None: the proxy's `--run` alone."""

    @property
    def patterns(self) -> tuple[str, ...]:
        """The prefixes of its run patterns (`"sweep-*"`: `"sweep-"`; `"*"`: every run)."""
        return tuple(sorted(r[:-1] for r in self.runs or () if r.endswith("*")))

    def allowed(self, default_run: str, registered: Collection[str] = ()) -> frozenset[str]:
        """The runs it may touch now: those it names, and the `registered` runs its patterns match."""
        if self.runs is None:
            return frozenset((default_run,))
        named = {r for r in self.runs if not r.endswith("*")}
        prefixes = self.patterns
        return frozenset(named | {r for r in registered if prefixes and r.startswith(prefixes)})

    def run_of(self, asked: str | None, default_run: str, registered: Collection[str] = ()) -> str:
        """The run a request of this token is for: `asked` (its header), or without one the
        proxy's `default_run` if the token may touch it, else the token's only run.
        `registered`: the runs started on the proxy's Redis, which its patterns match. Raises
        RunRefused with what to change."""
        allowed = self.allowed(default_run, registered)
        if asked is not None and asked not in allowed and self.patterns and asked.startswith(self.patterns):
            raise RunRefused(
                f"run {asked!r} is not started: the token {self.name!r} may touch it once its learner has started it"
            )
        if asked is None:
            if default_run in allowed:
                return default_run
            if len(allowed) == 1 and not self.patterns:
                return next(iter(allowed))
            several = ", ".join(sorted(self.runs or allowed))
            raise RunRefused(f"the token {self.name!r} may touch runs {several}: name one (--run)")
        if asked not in allowed:
            runs = ", ".join(repr(r) for r in sorted(allowed))
            raise RunRefused(
                f"the token {self.name!r} may not touch run {asked!r}: "
                f"the proxy serves run{'s' if len(allowed) > 1 else ''} {runs} for it"
            )
        return asked

    def __repr__(self) -> str:  # never the secret, not even its digest
        return f"Token(name={self.name!r}, role={self.role!r})"


class Tokens:
    def __init__(self, tokens: list[Token]) -> None:
        if not tokens:
            raise TokenError("no tokens configured: nobody could use the proxy")
        self.tokens = tokens

    @classmethod
    def from_toml(cls, text: str, source: str = "tokens") -> Tokens:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise TokenError(f"{source}: {err}") from None
        entries = data.get("tokens")
        if not isinstance(entries, list):
            raise TokenError(f"{source}: expected [[tokens]] tables")
        tokens, names, secrets = [], set(), set()
        for i, entry in enumerate(entries):
            where = f"{source}: tokens[{i}]"
            if not isinstance(entry, dict) or set(entry) - {"name", "role", "secret", "workers", "runs"}:
                raise TokenError(f"{where}: only name, role, secret, workers and runs are allowed")
            name, role, secret = entry.get("name"), entry.get("role"), entry.get("secret")
            if not isinstance(name, str) or not _NAME.match(name):
                raise TokenError(f"{where}: name must be 1-64 letters, digits, '.', '_' or '-'")
            if role not in ROLES:
                raise TokenError(f"{where} ({name}): role must be one of {', '.join(ROLES)}")
            if not isinstance(secret, str) or len(secret) < MIN_SECRET:
                raise TokenError(f"{where} ({name}): secret must be at least {MIN_SECRET} characters")
            if secret.startswith(PLACEHOLDER):
                raise TokenError(
                    f"{where} ({name}): secret is the example's placeholder; make one with "
                    '`python -c "import secrets; print(secrets.token_urlsafe(32))"`'
                )
            workers = entry.get("workers")
            if workers is not None and (
                role != "actor"
                or isinstance(workers, bool)
                or not isinstance(workers, int)
                or not 1 <= workers <= MAX_WORKERS
            ):
                raise TokenError(f"{where} ({name}): workers is for an actor token: a whole number 1-{MAX_WORKERS}")
            runs = entry.get("runs")
            if runs is not None and (
                not isinstance(runs, list)
                or not 1 <= len(runs) <= MAX_RUNS
                or not all(isinstance(r, str) and (_NAME.match(r) or _PATTERN.match(r)) for r in runs)
                or len(set(runs)) != len(runs)
            ):
                raise TokenError(
                    f"{where} ({name}): runs must be a list of 1-{MAX_RUNS} distinct run names "
                    "(1-64 letters, digits, '.', '_' or '-'), or patterns ending in * (\"sweep-*\")"
                )
            if runs is not None and role == "learner" and (len(runs) != 1 or runs[0].endswith("*")):
                raise TokenError(
                    f"{where} ({name}): a learner token belongs to one run, by name; it names {', '.join(runs)}"
                )
            if name in names or secret in secrets:
                raise TokenError(f"{where} ({name}): names and secrets must be unique")
            names.add(name)
            secrets.add(secret)
            digest = hashlib.sha256(secret.encode()).digest()
            tokens.append(Token(name, role, digest, workers, None if runs is None else frozenset(runs)))
        return cls(tokens)

    @classmethod
    def from_file(cls, path: Path) -> Tokens:
        try:
            return cls.from_toml(path.read_text(), str(path))
        except OSError as err:
            raise TokenError(f"{path}: {err}") from None

    def runs(self) -> set[str]:
        """Every run some token names or matches with a pattern (as the pattern)."""
        return {run for token in self.tokens for run in token.runs or ()}

    def patterns(self) -> bool:
        """Whether a token has run patterns (then the proxy reads which runs are started)."""
        return any(token.patterns for token in self.tokens)

    def check(self, secret: str) -> Token | None:
        """The token with this secret, or None; the time taken does not depend on which."""
        digest = hashlib.sha256(secret.encode()).digest()
        found = None
        for token in self.tokens:
            if hmac.compare_digest(digest, token.digest):
                found = token
        return found
