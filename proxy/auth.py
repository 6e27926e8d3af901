"""Bearer tokens with one role each, from a TOML file or an environment variable.

    [[tokens]]
    name = "spot-fleet-a"   # shows up in logs and metrics instead of the secret
    role = "actor"          # actor | learner | admin
    secret = "..."          # at least 32 characters
    workers = 1000          # optional, actors: a fleet of this many workers (sizes its caps)

The variable `SPOTGRPO_TOKENS` holds the same TOML text. Secrets are compared in
constant time against every known token and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["actor", "learner", "admin"]
ROLES: tuple[Role, ...] = ("actor", "learner", "admin")
MIN_SECRET = 32
MAX_WORKERS = 100_000
PLACEHOLDER = "REPLACE-"
"""How `proxy/tokens.example.toml`'s secrets begin: refused, so a copied example never serves."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TokenError(ValueError):
    """The tokens file is invalid."""


@dataclass(frozen=True)
class Token:
    name: str
    role: Role
    digest: bytes
    """sha256 of the secret: what is compared, so secrets of any length compare in the same time."""
    workers: int | None = None
    """A fleet's token: the workers it is for. Its caps (event streams, long-polls, live
    workers, requests/s, body bytes) are sized for them (`proxy.handlers.ProxyLimits.caps`)
    in place of the proxy's per-token flags, so a stolen copy holds no more than that fleet does."""

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
            if not isinstance(entry, dict) or set(entry) - {"name", "role", "secret", "workers"}:
                raise TokenError(f"{where}: only name, role, secret and workers are allowed")
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
            if name in names or secret in secrets:
                raise TokenError(f"{where} ({name}): names and secrets must be unique")
            names.add(name)
            secrets.add(secret)
            tokens.append(Token(name, role, hashlib.sha256(secret.encode()).digest(), workers))
        return cls(tokens)

    @classmethod
    def from_file(cls, path: Path) -> Tokens:
        try:
            return cls.from_toml(path.read_text(), str(path))
        except OSError as err:
            raise TokenError(f"{path}: {err}") from None

    def check(self, secret: str) -> Token | None:
        """The token with this secret, or None; the time taken does not depend on which."""
        digest = hashlib.sha256(secret.encode()).digest()
        found = None
        for token in self.tokens:
            if hmac.compare_digest(digest, token.digest):
                found = token
        return found
