"""Strings that one party writes and another logs, shows or uses as a name.

An actor controls worker names, engine names, errors, reward-function names and
timing keys. Any of them may end up in a log line, a terminal table, a Prometheus label
or a metric key, so the wire refuses the characters that can rewrite what a person sees
(`UNSAFE`): C0 and C1 controls and DEL (escape sequences, carriage returns, window
titles), and the Unicode format characters that reorder or hide text (bidi overrides and
isolates, zero-width characters, line and paragraph separators, and the characters that
render as nothing: tag characters, variation selectors, fillers, the soft hyphen). Code that makes such a
string from text it did not choose (an exception's message) passes it through
`printable` first, which escapes those characters instead of refusing them.
"""

from __future__ import annotations

import re

UNSAFE = (
    "\x00-\x1f\x7f-\x9f"  # C0, DEL, C1 (CSI is \x9b)
    "\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff"  # bidi marks, zero-width, separators, overrides, isolates
    # invisible or blank: soft hyphen, grapheme joiner, Hangul fillers, Khmer and Mongolian
    # vowel marks and selectors, variation selectors, interlinear annotations, tag characters
    "\u00ad\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164\ufe00-\ufe0f\uffa0\ufff9-\ufffb"
    "\U0001d173-\U0001d17a\U000e0000-\U000e007f\U000e0100-\U000e01ef"
)
"""A regular-expression character class body: the characters no actor-written label may hold."""

_UNSAFE = re.compile(f"[{UNSAFE}]")

SAFE_LINE = f"^[^{UNSAFE}]*$"
"""A pattern for one line of safe text (empty allowed)."""
SAFE_NAME = f"^[^{UNSAFE}]+$"
"""A pattern for a non-empty name of safe characters."""


def is_safe(text: str) -> bool:
    return _UNSAFE.search(text) is None


def printable(text: str, limit: int = 500) -> str:
    """One line of at most `limit` characters, with every unsafe character written as an
    escape (`\\x1b`, `\\u202e`), so it can be logged and sent as it is."""
    escaped = _UNSAFE.sub(lambda m: _escape(m.group()), str(text))
    return escaped if len(escaped) <= limit else escaped[: max(0, limit - 1)] + "…"


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
