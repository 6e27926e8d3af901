"""The scoring tier's reading of a group's episodes before it scores them: a mask only
where the batch has tools, and every environment span derived from the model's turns
(`protocol.usercode.transcript`). A group that fails is rejected with the reason, whole: its
rewards would score tokens the learner does not train, or train tokens they did not
score. The counts the learner reports (turns, tool calls, the turn limit) are the tier's
recount, not the actor's."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol import Completion
from protocol.usercode.chat import ParsedTurn, stop_token_ids, tool_template
from protocol.usercode.transcript import Transcript, TranscriptError, Turn, read_transcript


@dataclass
class EpisodeReader:
    """The run's tokenizer, tool template and end-of-turn tokens, loaded on first use (a
    run without tools never pays for transformers in the tier), or given (`tokenizer`:
    the one `--environment` loaded already)."""

    model: str
    tokenizer: Any = None
    _rules: tuple[Any, str | None, tuple[int, ...]] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def rules(self) -> tuple[Any, str | None, tuple[int, ...]]:
        with self._lock:
            if self._rules is None:
                from learner.detokenize import load_generation_config, load_tokenizer

                tokenizer = self.tokenizer if self.tokenizer is not None else load_tokenizer(self.model)
                self._rules = (
                    tokenizer,
                    tool_template(tokenizer),
                    stop_token_ids(tokenizer, load_generation_config(self.model)),
                )
            return self._rules


def read_episodes(
    reader: EpisodeReader | None, completions: Sequence[Completion], tools: Sequence[str], max_turns: int | None
) -> list[Transcript] | None:
    """Each completion's transcript (None: single turns, nothing to read). `TranscriptError`
    says why the group is refused."""
    if not tools:
        masked = [i for i, c in enumerate(completions) if c.mask is not None]
        if masked:
            raise TranscriptError(
                f"completion {masked[0]} carries a mask, but its batch offers no tools: every "
                "token of a single-turn completion is the model's and is scored as such"
            )
        return None
    if reader is None:
        raise TranscriptError("the scoring tier has no tokenizer to read episodes with")
    tokenizer, template, stop_ids = reader.rules()
    out = []
    for i, c in enumerate(completions):
        try:
            out.append(
                read_transcript(
                    tokenizer,
                    template,
                    stop_ids,
                    c.tokens.tolist(),
                    None if c.mask is None else list(c.mask),
                    max_turns,
                )
            )
        except TranscriptError as err:
            raise TranscriptError(f"completion {i}: {err}") from None
    return out


def recounted(completions: Sequence[Completion], transcripts: Sequence[Transcript] | None) -> list[Completion]:
    """The completions with the tier's own counts of turns, calls, failed calls and the
    turn limit in place of the actor's."""
    if transcripts is None:
        return [msgspec.structs.replace(c, turns=1, tool_calls=0, tool_errors=0, turn_limit=False) for c in completions]
    return [
        msgspec.structs.replace(
            c, turns=max(1, len(t.turns)), tool_calls=t.tool_calls, tool_errors=t.tool_errors, turn_limit=t.turn_limit
        )
        for c, t in zip(completions, transcripts, strict=True)
    ]


def single_turns(completions: Sequence[Completion]) -> list[Transcript]:
    """Transcripts of completions known to be single turns (no tokenizer needed)."""
    return [Transcript((Turn(0, c.tokens.size, ParsedTurn([]), ()),), None) for c in completions]
