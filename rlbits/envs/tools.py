"""Tool calling: a registry of Python callables, parsing calls from the model's text, and ``ToolEnv``.

The call format is Hermes-style, what Qwen2.5 / SmolLM3 / Hermes chat templates render and expect::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12345 * 6789"}}
    </tool_call>

and results go back as ``<tool_response>...</tool_response>``. Where the tokenizer's chat template has this tool
format (its template contains ``<tool_call>``), ``ToolEnv`` renders the tool results through
``apply_chat_template`` with the ``tool`` role, so the observation is exactly the text the template would have
put there (turn end, role header, wrapping, generation prompt). Where it has none (GPT-2, SmolLM2-135M), the
documented default is the same tags as plain text: the prompt lists the tools' JSON schemas and asks for
``<tool_call>`` JSON (:func:`plain_tools_prompt`), and each result is appended as
``\\n<tool_response>\\n{result}\\n</tool_response>\\n`` inside the running text. Another format is a
:class:`ToolFormat` with other tags.

A schema is the JSON schema ``transformers.utils.get_json_schema`` derives from a function's type hints and its
Google-style docstring (``Args:`` section), the format ``apply_chat_template(tools=...)`` takes.

Nothing a model writes crashes the env: malformed JSON, an unknown tool, wrong arguments, an exception in the
tool and a timeout each come back as a :class:`ToolResult` with ``ok=False`` whose text says what went wrong.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlbits.envs.base import Observation, StepResult, StopConditions, map_ordered


@dataclass(frozen=True)
class ToolFormat:
    """The tags around a tool call and a tool result in the model's text."""

    call_open: str = "<tool_call>"
    call_close: str = "</tool_call>"
    response_open: str = "<tool_response>"
    response_close: str = "</tool_response>"


HERMES = ToolFormat()


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the model's text. ``error`` is set (and ``name`` may be None) when the text between
    the tags is not a valid call; ``raw`` is that text."""

    name: str | None
    arguments: dict[str, Any]
    raw: str
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: ``content`` is the text shown to the model, ``ok`` False for every failure."""

    name: str | None
    content: str
    ok: bool
    seconds: float = 0.0


@dataclass(frozen=True)
class Tool:
    """A callable with its JSON schema (``{"type": "function", "function": {"name", "description",
    "parameters"}}``) and a per-call timeout in seconds."""

    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float = 10.0

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def _describe(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x, ensure_ascii=False, default=str)


def parse_tool_calls(text: str, fmt: ToolFormat = HERMES) -> list[ToolCall]:
    """Every tool call in ``text``, in order; ``[]`` when there is none.

    A call is ``{call_open}{json}{call_close}`` with ``json`` an object ``{"name": str, "arguments": object}``
    (``arguments`` may also be a JSON string of an object, as some models write it, or missing: ``{}``). A
    ``call_open`` with no ``call_close`` after it (a turn cut at ``max_new_tokens``) is a call with an error.
    Malformed calls are returned with ``error`` set, never raised.

    Raises:
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls: text must be a str, got {type(text).__name__}")
    calls, pos = [], 0
    while (start := text.find(fmt.call_open, pos)) != -1:
        body_start = start + len(fmt.call_open)
        end = text.find(fmt.call_close, body_start)
        if end == -1:
            raw = text[body_start:]
            calls.append(ToolCall(None, {}, raw, f"the call has no closing {fmt.call_close}"))
            break
        raw = text[body_start:end]
        calls.append(_parse_one(raw))
        pos = end + len(fmt.call_close)
    return calls


def _parse_one(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, raw, f"the call is not valid JSON ({e.msg} at character {e.pos})")
    except RecursionError:
        return ToolCall(None, {}, raw, "the call's JSON is nested too deeply")
    if not isinstance(obj, dict):
        return ToolCall(None, {}, raw, 'the call must be a JSON object {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, raw, 'the call has no "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(name, {}, raw, '"arguments" is a string that is not a JSON object')
    if not isinstance(args, dict):
        return ToolCall(name, {}, raw, f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name, args, raw)


_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, spec: Mapping[str, Any]) -> bool:
    types = spec.get("type")
    if types is None:
        return True
    types = [types] if isinstance(types, str) else list(types)
    for t in types:
        py = _JSON_TYPES.get(t)
        if py is None:
            return True  # a type we do not check
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, py):
            return True
    return False


class ToolRegistry:
    """Named tools with their schemas. ``registry.schemas()`` is what ``apply_chat_template(tools=...)`` takes;
    ``registry.call(call)`` / ``registry.call_many(calls)`` run parsed calls and never raise.

    Example::

        reg = ToolRegistry()
        reg.register(calculator)
        reg.call_many(parse_tool_calls(text), max_workers=4)
    """

    def __init__(self, tools: Sequence[Callable[..., Any]] = (), *, timeout_s: float = 10.0):
        self._tools: dict[str, Tool] = {}
        for fn in tools:
            self.register(fn, timeout_s=timeout_s)

    def register(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        schema: dict[str, Any] | None = None,
        timeout_s: float = 10.0,
    ) -> Tool:
        """Add ``fn``; its schema comes from ``transformers.utils.get_json_schema`` (type hints + a Google-style
        docstring with an ``Args:`` entry per parameter) unless ``schema`` is given.

        Raises:
            ValueError: the name is taken, ``timeout_s <= 0``, or the schema cannot be derived (the message
                says why, e.g. a parameter without a type hint or without a docstring entry).
        """
        if schema is None:
            from transformers.utils import get_json_schema  # lazy: transformers is heavy to import

            try:
                schema = get_json_schema(fn)
            except Exception as e:  # DocstringParsingException, TypeHintParsingException
                raise ValueError(f"ToolRegistry.register: cannot derive a JSON schema for {fn!r}: {e}") from e
        schema = json.loads(json.dumps(schema))  # a private copy
        if name is not None:
            schema["function"]["name"] = name
        if timeout_s <= 0:
            raise ValueError(f"ToolRegistry.register: timeout_s must be > 0, got {timeout_s}")
        tool = Tool(fn, schema, timeout_s)
        if tool.name in self._tools:
            raise ValueError(f"ToolRegistry.register: a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, in registration order (for ``apply_chat_template(tools=...)``)."""
        return [json.loads(json.dumps(t.schema)) for t in self._tools.values()]

    def check_arguments(self, name: str, arguments: Mapping[str, Any]) -> str | None:
        """``None`` when ``arguments`` fit tool ``name``'s schema (required present, no unknown names, JSON
        types right), else a message saying what is wrong."""
        params = self._tools[name].schema["function"].get("parameters", {})
        props = params.get("properties", {})
        missing = [p for p in params.get("required", []) if p not in arguments]
        if missing:
            return f"missing required argument(s) {missing} for {name}; it takes {sorted(props)}"
        unknown = [a for a in arguments if a not in props]
        if unknown:
            return f"unknown argument(s) {unknown} for {name}; it takes {sorted(props)}"
        for a, v in arguments.items():
            if not _type_ok(v, props[a]):
                return (
                    f"argument {a!r} of {name} must be of type {props[a].get('type')}, got {_describe(v)!r}"
                )
        return None

    def call(self, call: ToolCall) -> ToolResult:
        """Run one parsed call with its tool's timeout. Never raises: every failure is a ``ToolResult`` with
        ``ok=False`` whose ``content`` starts with ``Error:``.

        A tool that overruns its timeout is abandoned, not killed (Python cannot kill a thread): it keeps a
        daemon thread until it returns. Tools that may hang should bound themselves (the sandbox tool does).
        """
        if call.error is not None:
            return ToolResult(call.name, f"Error: malformed tool call: {call.error}", False)
        if call.name not in self._tools:
            return ToolResult(
                call.name,
                f"Error: unknown tool {call.name!r}; available tools: {', '.join(self.names)}",
                False,
            )
        problem = self.check_arguments(call.name, call.arguments)
        if problem is not None:
            return ToolResult(call.name, f"Error: bad arguments: {problem}", False)
        tool = self._tools[call.name]
        box: dict[str, Any] = {}

        def target():
            try:
                box["value"] = tool.fn(**call.arguments)
            except BaseException as e:  # noqa: BLE001 - the model sees the error instead of the env crashing
                box["error"] = e

        start = time.monotonic()
        thread = threading.Thread(target=target, name=f"tool-{call.name}", daemon=True)
        thread.start()
        thread.join(tool.timeout_s)
        seconds = time.monotonic() - start
        if thread.is_alive():
            return ToolResult(
                call.name, f"Error: {call.name} timed out after {tool.timeout_s:g} s", False, seconds
            )
        if "error" in box:
            e = box["error"]
            return ToolResult(call.name, f"Error: {call.name} raised {type(e).__name__}: {e}", False, seconds)
        return ToolResult(call.name, _describe(box.get("value")), True, seconds)

    def call_many(self, calls: Sequence[ToolCall], *, max_workers: int = 4) -> list[ToolResult]:
        """``[self.call(c) for c in calls]`` with at most ``max_workers`` calls running at once; results in
        the order of ``calls``.

        Raises:
            ValueError: ``max_workers < 1``.
        """
        return map_ordered(self.call, calls, max_workers)


def plain_tools_prompt(schemas: Sequence[Mapping[str, Any]], fmt: ToolFormat = HERMES) -> str:
    """The default tool instructions for a tokenizer whose chat template has no tool format: the schemas as
    JSON lines and how to call them (the same wording as Hermes-style templates use)."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        "You may call one or more functions to assist with the user query. The available functions:\n"
        f"{lines}\n"
        "To call a function, write a JSON object with its name and arguments between tags:\n"
        f'{fmt.call_open}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{fmt.call_close}\n'
        f"Each result comes back between {fmt.response_open} and {fmt.response_close}."
    )


def template_has_tools(tokenizer: Any, fmt: ToolFormat = HERMES) -> bool:
    """Whether ``tokenizer`` has a chat template that renders ``fmt``'s tool calls (it contains ``call_open``)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and fmt.call_open in template


class ToolEnv:
    """An env (``rlbits.envs.base.Env``) whose actions may call tools.

    ``reset(prompt or row)``: the row is a string or a mapping with a ``"prompt"`` key (the rest is kept for
    ``reward_fn``). The first observation is the prompt rendered with the chat template and the tool schemas
    (template mode) or :func:`plain_tools_prompt` + a blank line + the prompt (plain mode; ``tools_prompt=False``
    leaves the instructions out, for models trained on a fixed format).

    ``step(action_text, action_ids)``: the calls in the action run (concurrently, at most ``max_workers``) and
    their results come back as the observation, reward 0, not done; an action without a call ends the episode
    with reward ``reward_fn(row, action_text)`` (0 without one). After ``max_turns`` turns the episode is done
    (no observation). ``info`` holds ``tool_calls`` (names), ``tool_ok`` and ``tool_errors``.

    Args:
        registry: the tools.
        tokenizer: used only for its chat template (``mode="template"``) and EOS; may be None in plain mode.
        mode: ``"template"`` (render prompt and results with ``apply_chat_template``; the template must contain
            the call tag), ``"plain"`` (the documented default, text tags), or ``"auto"`` (template when
            :func:`template_has_tools`, else plain).
        fmt: the tags (Hermes by default).
        stop_at_call: end the turn at ``fmt.call_close`` (one call a turn) rather than only at EOS.
        max_turns, max_new_tokens: the episode's :class:`StopConditions`.
        max_workers: bound on concurrent tool calls within a turn.
        reward_fn: ``(row, final_action_text) -> float`` for the final turn.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        *,
        tokenizer: Any = None,
        mode: str = "auto",
        fmt: ToolFormat = HERMES,
        stop_at_call: bool = True,
        max_turns: int = 4,
        max_new_tokens: int = 256,
        max_workers: int = 4,
        reward_fn: Callable[[Mapping[str, Any], str], float] | None = None,
        tools_prompt: bool = True,
    ):
        if mode not in ("auto", "template", "plain"):
            raise ValueError(f"ToolEnv: mode must be 'auto', 'template' or 'plain', got {mode!r}")
        if mode == "auto":
            mode = "template" if template_has_tools(tokenizer, fmt) else "plain"
        if mode == "template" and not template_has_tools(tokenizer, fmt):
            raise ValueError(
                f"ToolEnv: mode='template' needs a tokenizer whose chat template renders {fmt.call_open} "
                "tool calls; use mode='plain' (text tags) for this tokenizer"
            )
        if max_workers < 1:
            raise ValueError(f"ToolEnv: max_workers must be >= 1, got {max_workers}")
        self.registry, self.tokenizer, self.mode, self.fmt = registry, tokenizer, mode, fmt
        self.max_workers, self.reward_fn, self.tools_prompt = max_workers, reward_fn, tools_prompt
        self.stop = StopConditions(
            stop_strings=(fmt.call_close,) if stop_at_call else (),
            max_new_tokens=max_new_tokens,
            max_turns=max_turns,
        )
        self.row: dict[str, Any] = {}
        self.turns = 0

    def reset(self, prompt: str | Mapping[str, Any]) -> Observation:
        """Start an episode; return the prompt (with the tools) as the first observation.

        Raises:
            ValueError: a row without a ``"prompt"`` string.
        """
        row = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
        if not isinstance(row.get("prompt"), str):
            raise ValueError(
                f"ToolEnv.reset: need a prompt string or a row with a 'prompt' string, got {prompt!r}"
            )
        self.row, self.turns = row, 0
        if self.mode == "template":
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}],
                tools=self.registry.schemas(),
                add_generation_prompt=True,
                tokenize=False,
            )
        elif self.tools_prompt:
            text = plain_tools_prompt(self.registry.schemas(), self.fmt) + "\n\n" + row["prompt"]
        else:
            text = row["prompt"]
        return Observation(text=text)

    def step(self, action_text: str, action_ids: Sequence[int] | None = None) -> StepResult:
        """Run the action's tool calls and return their results (see the class docstring)."""
        self.turns += 1
        calls = parse_tool_calls(action_text, self.fmt)
        if not calls:
            reward = float(self.reward_fn(self.row, action_text)) if self.reward_fn is not None else 0.0
            return StepResult(
                Observation(), reward, True, {"tool_calls": [], "tool_ok": [], "tool_errors": []}
            )
        results = self.registry.call_many(calls, max_workers=self.max_workers)
        info = {
            "tool_calls": [r.name for r in results],
            "tool_ok": [r.ok for r in results],
            "tool_errors": [r.content for r in results if not r.ok],
        }
        if self.turns >= self.stop.max_turns:
            return StepResult(Observation(), 0.0, True, {**info, "stop_reason": "max_turns"})
        return StepResult(
            Observation(text=self.render_results(results, action_text, action_ids)), 0.0, False, info
        )

    def render_results(
        self, results: Sequence[ToolResult], action_text: str = "", action_ids: Sequence[int] | None = None
    ) -> str:
        """The observation text for ``results``.

        Plain mode: ``"\\n<tool_response>\\n{content}\\n</tool_response>"`` per result, then a newline.
        Template mode: what ``apply_chat_template`` puts between the end of the assistant's text and the start
        of the next assistant turn when the conversation continues with one ``tool`` message per result
        (rendered once with a placeholder as the assistant's text and cut after it). When the action already
        ended with the tokenizer's EOS text (or id), that leading EOS is dropped so it is not written twice.
        """
        if self.mode == "plain":
            f = self.fmt
            return "".join(f"\n{f.response_open}\n{r.content}\n{f.response_close}" for r in results) + "\n"
        marker = "\x1frlbits-action\x1f"
        messages = [
            {"role": "user", "content": self.row.get("prompt", "")},
            {"role": "assistant", "content": marker},
            *({"role": "tool", "name": r.name or "unknown", "content": r.content} for r in results),
        ]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        obs = text[text.index(marker) + len(marker) :]
        eos = getattr(self.tokenizer, "eos_token", None)
        eos_id = getattr(self.tokenizer, "eos_token_id", None)
        ended = bool(eos) and (action_text.endswith(eos) or (bool(action_ids) and action_ids[-1] == eos_id))
        if ended and obs.startswith(eos):
            obs = obs[len(eos) :]
        return obs


__all__ = [
    "HERMES",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolFormat",
    "ToolRegistry",
    "ToolResult",
    "parse_tool_calls",
    "plain_tools_prompt",
    "template_has_tools",
]
