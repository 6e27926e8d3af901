"""Chat templates for episodes: offering tools to the model, reading its tool calls, and
the template's tokens around a tool's result.

The learner renders each prompt with the tools' JSON schemas (`tools=` of
`apply_chat_template`, as TRL does); the actor reads the model's tool calls with
transformers' response parser (`tokenizer.parse_response`) and appends each tool result
as the template renders it, by TRL's method: the tokens a tool turn adds after an
assistant turn that called a tool. Both sides must render with the same template:
`tool_template` picks it, from the tokenizer alone.

A template that cannot render a tool-calling exchange (SmolLM2-Instruct's is plain
ChatML) gets `HERMES_CHATML`, Qwen2.5's tool template as TRL ships it (tools in the system
turn, `<tool_call>` JSON, results in `<tool_response>`), with the same
`<|im_start|>`/`<|im_end|>` turns and without Qwen's default system line; a warning says
so. Any other template without tools is refused with what to do.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.usercode.rewards import RewardError, load_reward

log = logging.getLogger(__name__)


class ToolTemplateError(ValueError):
    """The model's chat template cannot offer tools, and no fallback fits it."""


HERMES_CHATML = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""Qwen2.5's tool-calling ChatML template (TRL's `chat_templates/qwen2_5.jinja`), without
its default "You are Qwen" system turn."""

HERMES_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
"""transformers' response template for Hermes-style `<tool_call>` JSON (TRL's `qwen3_template`),
for a tokenizer that has none of its own."""

TOOL_CALL_OPEN = "<tool_call>"


def _probe(tokenizer: Any, template: str | None) -> bool:
    """Whether `template` renders a whole tool-calling exchange (TRL's
    `supports_tool_calling`: the call's name, arguments and the result all appear)."""
    marks = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4", "tool_arg_val_d6e7", "tool_content_c4f9")
    calls = [{"type": "function", "function": {"name": marks[0], "arguments": {marks[1]: marks[2]}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": marks[0], "content": marks[3]},
    ]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
    except Exception:  # jinja's TemplateError and what templates raise on roles they refuse
        return False
    return all(m in rendered for m in marks)


def tool_template(tokenizer: Any) -> str | None:
    """The chat template episodes are rendered with: None for the tokenizer's own (it can
    render tool calls), `HERMES_CHATML` for a ChatML template that cannot."""
    if getattr(tokenizer, "chat_template", None) and _probe(tokenizer, None):
        return None
    if "<|im_start|>" in (getattr(tokenizer, "chat_template", None) or "") and _probe(tokenizer, HERMES_CHATML):
        return HERMES_CHATML
    raise ToolTemplateError(
        "the model's chat template cannot render tool calls and is not ChatML: give a model whose template "
        "offers tools (Qwen2.5, Llama 3.1, ...), or set a tool-calling template on its tokenizer"
    )


_SAID: list[bool] = []


def say_template(template: str | None) -> None:
    """One warning, once per process, when the fallback template is in use."""
    if template is HERMES_CHATML and not _SAID:
        _SAID.append(True)
        log.warning(
            "the model's chat template has no tools section: episodes use Qwen2.5's ChatML tool template "
            "(TRL's), which lists the tools' JSON schemas in the system turn and reads <tool_call> JSON"
        )


def tool_schemas(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schemas transformers builds from each tool's signature and docstring (a
    tool without a documented argument is refused here, with transformers' reason)."""
    from transformers.utils.chat_template_utils import get_json_schema

    schemas = []
    for fn in tools:
        try:
            schemas.append(get_json_schema(fn))
        except Exception as err:  # DocstringParsingException, TypeHintParsingException
            raise ToolTemplateError(f"tool {getattr(fn, '__name__', fn)!r}: {err}") from None
    return schemas


class ToolError(ValueError):
    """A tool specification cannot be loaded or described."""


def load_tool(spec: str) -> Callable[..., Any]:
    """`module:function` (or `module.function`) -> the function, with a one-line error."""
    if "=" in spec:
        raise ToolError(f"--tools {spec!r}: a tool has no weight; expected module:function")
    try:
        return load_reward(spec).fn
    except RewardError as err:
        raise ToolError(str(err).replace("--reward", "--tools", 1)) from None


def load_tools(specs: list[str]) -> list[Callable[..., Any]]:
    """The tools, each described (a missing docstring or type hint is refused here)."""
    return load_episode_tools(specs, None)[0]


ENVIRONMENT_HOOKS = frozenset({"reset", "get_reward", "close"})
"""An environment's methods that are not tools."""


def load_environment(spec: str) -> type:
    """`module:Class` (TRL's `environment_factory`): one instance per episode, built with no
    arguments; `reset(**columns)` (if defined) prepares it from the prompt's public columns;
    its public methods are the episode's tools; setting its `done` attribute to true ends
    the episode after the call."""
    if "=" in spec:
        raise ToolError(f"--environment {spec!r}: expected module:Class")
    try:
        cls = load_reward(spec).fn
    except RewardError as err:
        raise ToolError(str(err).replace("--reward", "--environment", 1).replace("function", "class")) from None
    if not isinstance(cls, type):
        raise ToolError(f"--environment {spec!r}: {cls!r} is not a class")
    return cls


def environment_methods(instance: Any) -> list[Callable[..., Any]]:
    """An environment's tools: its public methods, bar `ENVIRONMENT_HOOKS`."""
    return [
        getattr(instance, name)
        for name in sorted(dir(type(instance)))
        if not name.startswith("_") and name not in ENVIRONMENT_HOOKS and callable(getattr(instance, name))
    ]


def load_episode_tools(specs: list[str], environment: str | None) -> tuple[list[Callable[..., Any]], type | None]:
    """`--tools` and an `--environment`'s methods, all described: (the tools, the class)."""
    cls = load_environment(environment) if environment else None
    try:
        methods = environment_methods(cls()) if cls is not None else []
    except Exception as err:  # the user's constructor
        raise ToolError(
            f"--environment {environment!r}: {getattr(cls, '__name__', cls)}() raised {type(err).__name__}: {err}"
        ) from None
    if cls is not None and not methods:
        raise ToolError(f"--environment {environment!r}: {cls.__name__} has no public method to offer as a tool")
    tools = [load_tool(spec) for spec in specs] + methods
    names = [fn.__name__ for fn in tools]
    if len(set(names)) != len(names):
        raise ToolError(f"--tools: two tools share a name ({sorted(n for n in names if names.count(n) > 1)[0]})")
    try:
        tool_schemas(tools)
    except ToolTemplateError as err:
        raise ToolError(f"--tools: {err}") from None
    return tools, cls


END_OF_TURN_PROBE = "\x1fspotgrpo-end-of-turn-probe\x1f"


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> tuple[int, ...]:
    """What ends a completion: the tokenizer's EOS, the generation config's EOS ids
    (`generation_config.json`: Llama 3 lists several), and the chat template's end-of-turn
    token (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...), found by rendering an
    assistant turn and taking the special token that closes it."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(generation_config, "eos_token_id", None))
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": END_OF_TURN_PROBE}], tokenize=False
            )
        except Exception:  # a template that wants other turns: EOS is what we have
            text = ""
        after = text.split(END_OF_TURN_PROBE, 1)[1] if END_OF_TURN_PROBE in text else ""
        following = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(
            getattr(tokenizer, "added_tokens_decoder", {}) or {}
        )
        if following and following[0] in special:
            add(following[0])
    return tuple(ids)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall]
    error: str | None = None
    """Why the turn's tool calls could not be read (answered to the model as a tool error)."""


def parse_turn(tokenizer: Any, ids: Sequence[int], prefix: str | Sequence[int], template: str | None) -> ParsedTurn:
    """The tool calls of one model turn (`ids`, after `prefix`), by transformers' parser with
    the tokenizer's response template (or `HERMES_RESPONSE` with the fallback template, or
    when the tokenizer has none). A turn without a call has none; one whose call cannot
    be read says why. Callers pass `assistant_header` as the prefix (`model_turn_calls`):
    the parser keeps the regions the prefix closes, so a longer prefix would let calls
    written anywhere before the turn count as the turn's."""
    schema = None if template is None and getattr(tokenizer, "response_template", None) else HERMES_RESPONSE
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    try:
        parsed = tokenizer.parse_response(
            list(ids), schema=schema, prefix=prefix if isinstance(prefix, str) else list(prefix)
        )
    except (ValueError, TypeError, KeyError, RecursionError) as err:
        if TOOL_CALL_OPEN in text:
            return ParsedTurn(
                [], f"the tool call could not be read: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            )
        return ParsedTurn([])
    calls, errors = [], []
    for call in (parsed or {}).get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):  # a 1,000-deep argument is as unreadable as a broken one
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict | None):
            errors.append("a tool call needs a name and an object of arguments")
            continue
        calls.append(ToolCall(name, arguments or {}))
    if not calls and not errors and TOOL_CALL_OPEN in text:
        errors.append(
            'the tool call could not be read: expected <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
        )
    return ParsedTurn(calls, errors[0] if errors else None)


@functools.lru_cache(maxsize=16)
def assistant_header(tokenizer: Any, template: str | None) -> str:
    """What the template writes before a model turn (`<|im_start|>assistant\n`, and any
    prefill such as an opening `<think>`): the generation prompt, found by rendering one user
    turn with and without it."""
    turn = [{"role": "user", "content": "hi"}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = tokenizer.apply_chat_template(turn, tokenize=False, chat_template=template)
        headed = tokenizer.apply_chat_template(turn, tokenize=False, chat_template=template, add_generation_prompt=True)
    return str(headed[len(bare) :]) if headed.startswith(bare) else ""


def model_turn_calls(tokenizer: Any, ids: Sequence[int], template: str | None) -> ParsedTurn:
    """The tool calls of one model turn read from its own tokens alone (after the assistant
    header): what the actor runs and what the trusted side checks and replays. Its cost is
    linear in the turn's tokens, whatever came before it."""
    return parse_turn(tokenizer, ids, assistant_header(tokenizer, template), template)


def tool_result_ids(
    tokenizer: Any, template: str | None, results: Sequence[tuple[str, str]], end_ids: Sequence[int]
) -> list[int]:
    """The tokens that follow a turn that called tools (and ended on one of `end_ids`, the
    engine's stop tokens): each result as a tool turn, then the next assistant turn's header
    (TRL's `_get_tool_suffix_ids`: render a dummy exchange with and without the results and
    keep the difference, from the end of the assistant turn)."""
    dummy = [
        {"role": "user", "content": "dummy"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": results[0][0], "arguments": {}}}],
        },
    ]
    tool_turns = [{"role": "tool", "name": name, "content": content} for name, content in results]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = list(tokenizer.apply_chat_template(dummy, tokenize=True, chat_template=template, return_dict=False))
        after = list(
            tokenizer.apply_chat_template(
                dummy + tool_turns, add_generation_prompt=True, tokenize=True, chat_template=template, return_dict=False
            )
        )
    ends = [i for i, t in enumerate(before) if t in end_ids]
    if ends:
        before = before[: ends[-1] + 1]
    if after[: len(before)] != before:
        raise ToolTemplateError("the chat template does not render a tool exchange as a prefix of the next turn")
    return after[len(before) :]


def model_turns(mask: Sequence[int] | None, n: int) -> list[tuple[int, int]]:
    """The (start, end) of each run of the model's tokens in an episode of `n` tokens."""
    if mask is None:
        return [(0, n)] if n else []
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def owns_reward(environment: type) -> bool:
    """Whether an environment scores its episodes itself (TRL's `get_reward`)."""
    return callable(getattr(environment, "get_reward", None))
