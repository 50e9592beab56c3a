"""Tool schemas, parsing calls, ToolEnv observations for every failure, bounded concurrency, the Env protocol."""

from __future__ import annotations

import json
import threading
import time

import pytest

from rlbits.envs import (
    Env,
    Observation,
    StepResult,
    StopConditions,
    ToolEnv,
    ToolRegistry,
    calculator,
    parse_tool_calls,
    step_all,
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def fail(message: str) -> str:
    """Always raise.

    Args:
        message: What to raise.
    """
    raise RuntimeError(message)


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def registry() -> ToolRegistry:
    reg = ToolRegistry([add, calculator, fail])
    reg.register(slow, timeout_s=0.2)
    return reg


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# --------------------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------------------


def test_schema_from_type_hints_and_docstring():
    (schema,) = ToolRegistry([add]).schemas()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "The first number."},
        "b": {"type": "integer", "description": "The second number."},
    }
    assert fn["parameters"]["required"] == ["a"]
    calc = ToolRegistry([calculator]).schemas()[0]["function"]
    assert calc["parameters"]["required"] == ["expression"]


def test_register_errors():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="cannot derive a JSON schema"):
        ToolRegistry([undocumented])
    reg = ToolRegistry([add])
    with pytest.raises(ValueError, match="already registered"):
        reg.register(add)
    reg.register(add, name="plus")
    assert reg.names == ["add", "plus"]


# --------------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------------


def test_parse_good_call():
    (c,) = parse_tool_calls("Let me add. " + call("add", a=2, b=3) + " then answer")
    assert (c.name, c.arguments, c.error) == ("add", {"a": 2, "b": 3}, None)


def test_parse_two_calls_in_order():
    calls = parse_tool_calls(call("add", a=1) + "\n" + call("calculator", expression="2*3"))
    assert [(c.name, c.arguments) for c in calls] == [
        ("add", {"a": 1}),
        ("calculator", {"expression": "2*3"}),
    ]


def test_parse_string_encoded_arguments():
    (c,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 4}"}</tool_call>')
    assert c.arguments == {"a": 4} and c.error is None


@pytest.mark.parametrize(
    "text,error",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "no closing </tool_call>"),
    ],
)
def test_parse_malformed(text, error):
    (c,) = parse_tool_calls(text)
    assert c.error is not None and error in c.error


def test_parse_text_without_a_call():
    assert parse_tool_calls("The answer is 42.") == []
    with pytest.raises(TypeError, match="text must be a str"):
        parse_tool_calls(None)


# --------------------------------------------------------------------------------------------------------
# ToolEnv observations: success and every failure
# --------------------------------------------------------------------------------------------------------


def plain_env(**kw) -> ToolEnv:
    env = ToolEnv(registry(), mode="plain", **kw)
    env.reset({"prompt": "What is 2 + 3?", "answer": "5"})
    return env


def test_env_is_an_env_and_reset_lists_the_tools():
    env = ToolEnv(registry(), mode="plain")
    assert isinstance(env, Env)
    assert env.stop == StopConditions(stop_strings=("</tool_call>",), max_new_tokens=256, max_turns=4)
    obs = env.reset("What is 2 + 3?")
    assert obs.text.endswith("\n\nWhat is 2 + 3?") and '"name": "calculator"' in obs.text
    assert "<tool_call>" in obs.text and obs.token_ids is None
    with pytest.raises(ValueError, match="'prompt' string"):
        env.reset({"question": "x"})


def test_env_runs_a_call():
    r = plain_env().step("I will add. " + call("add", a=2, b=3))
    assert r == StepResult(
        Observation(text="\n<tool_response>\n5\n</tool_response>\n"),
        0.0,
        False,
        {"tool_calls": ["add"], "tool_ok": [True], "tool_errors": []},
    )


@pytest.mark.parametrize(
    "action,message",
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
            "Error: malformed tool call: the call is not",
        ),
        (
            call("multiply", a=1),
            "Error: unknown tool 'multiply'; available tools: add, calculator, fail, slow",
        ),
        (call("add", b=1), "Error: bad arguments: missing required argument(s) ['a'] for add"),
        (call("add", a=1, c=2), "Error: bad arguments: unknown argument(s) ['c'] for add"),
        (call("add", a="one"), "Error: bad arguments: argument 'a' of add must be of type integer"),
        (call("fail", message="boom"), "Error: fail raised RuntimeError: boom"),
        (
            call("calculator", expression="1/0"),
            "Error: calculator raised ZeroDivisionError: division by zero",
        ),
        (call("slow", seconds=1), "Error: slow timed out after 0.2 s"),
        (
            "<tool_call>" + "[" * 5000 + "</tool_call>",
            "Error: malformed tool call: the call's JSON is nested too deeply",
        ),
        (
            '<tool_call>{"name": "add", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>",
            "Error: malformed tool call: the call's JSON is nested too deeply",
        ),
    ],
    ids=lambda x: x[:40] if isinstance(x, str) else None,
)
def test_env_failures_are_observations(action, message):
    r = plain_env().step(action)
    assert not r.done and r.reward == 0.0
    assert r.observation.text.startswith("\n<tool_response>\n" + message), r.observation.text
    assert r.info["tool_ok"] == [False] and r.info["tool_errors"][0].startswith(message)


def test_env_final_answer_and_max_turns():
    env = plain_env(reward_fn=lambda row, text: float(row["answer"] in text), max_turns=2)
    assert env.step(call("add", a=2, b=3)).done is False
    r = env.step("The answer is 5.")
    assert r.done and r.reward == 1.0 and r.observation == Observation()
    env = plain_env(max_turns=1)
    r = env.step(call("add", a=2, b=3))
    assert r.done and r.info["stop_reason"] == "max_turns"


class QwenLikeTokenizer:
    """A stand-in for a Qwen2.5-style tokenizer: Hermes tool calls, tool results inside one user turn."""

    eos_token = "<|im_end|>"
    eos_token_id = 7
    chat_template = "... {{- '<tool_call>' }} ... <tool_response> ..."

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
        out = ""
        if tools:
            out += "<|im_start|>system\n# Tools\n<tools>\n"
            out += "\n".join(json.dumps(t) for t in tools) + "\n</tools><|im_end|>\n"
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                first = i == 0 or messages[i - 1]["role"] != "tool"
                last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
                out += (
                    "<|im_start|>user" if first else ""
                ) + f"\n<tool_response>\n{m['content']}\n</tool_response>"
                out += "<|im_end|>\n" if last else ""
            else:
                out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_template_mode_renders_the_tool_role():
    env = ToolEnv(registry(), tokenizer=QwenLikeTokenizer())
    assert env.mode == "template"
    obs = env.reset("What is 2 + 3?")
    assert obs.text.startswith("<|im_start|>system\n# Tools") and obs.text.endswith("<|im_start|>assistant\n")
    two = call("add", a=2, b=3) + "\n" + call("add", a=1)
    r = env.step(two)  # stopped at a stop string: the observation closes the assistant turn first
    want = "\n<tool_response>\n5\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>\n"
    assert r.observation.text == "<|im_end|>\n<|im_start|>user" + want + "<|im_start|>assistant\n"
    r = env.step(two + "<|im_end|>")  # stopped at EOS: not written twice
    assert r.observation.text == "\n<|im_start|>user" + want + "<|im_start|>assistant\n"


def test_mode_errors():
    with pytest.raises(ValueError, match="mode='plain'"):
        ToolEnv(registry(), mode="template", tokenizer=object())
    with pytest.raises(ValueError, match="mode must be"):
        ToolEnv(registry(), mode="json")
    assert ToolEnv(registry(), tokenizer=object()).mode == "plain"


# --------------------------------------------------------------------------------------------------------
# Bounded concurrency, results in order
# --------------------------------------------------------------------------------------------------------


class Gauge:
    """Counts calls running at once. The first ``bound`` calls wait for each other (a barrier), so the peak
    reaches the bound deterministically when the pool really runs that many at once."""

    def __init__(self, bound: int):
        self.lock, self.now, self.peak = threading.Lock(), 0, 0
        self.bound, self.barrier = bound, threading.Barrier(bound, timeout=5)

    def __call__(self, i: int) -> int:
        """Record concurrency.

        Args:
            i: The call's index.
        """
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        if i < self.bound:
            self.barrier.wait()
        time.sleep(0.01 * (3 - i % 3))  # later calls finish first: order must not come from finishing
        with self.lock:
            self.now -= 1
        return i * i


@pytest.mark.parametrize("bound", [1, 3])
def test_tool_calls_run_concurrently_with_a_bound(bound):
    gauge = Gauge(bound)
    reg = ToolRegistry()
    reg.register(gauge.__call__, name="gauge")
    calls = parse_tool_calls("".join(call("gauge", i=i) for i in range(9)))
    results = reg.call_many(calls, max_workers=bound)
    assert [r.content for r in results] == [str(i * i) for i in range(9)]
    assert gauge.peak == bound  # reached, never exceeded


def test_step_all_bounded_and_in_order():
    gauge = Gauge(2)

    class CountingEnv:
        stop = StopConditions()

        def __init__(self, i):
            self.i = i

        def reset(self, prompt):
            return Observation(text=prompt)

        def step(self, action_text, action_ids=None):
            return StepResult(Observation(text=action_text), float(gauge(self.i)), True)

    envs = [CountingEnv(i) for i in range(7)]
    results = step_all(envs, [f"a{i}" for i in range(7)], max_workers=2)
    assert [(r.observation.text, r.reward) for r in results] == [(f"a{i}", float(i * i)) for i in range(7)]
    assert gauge.peak == 2
    with pytest.raises(ValueError, match="one of each per episode"):
        step_all(envs, ["a"])
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        step_all(envs, ["a"] * 7, max_workers=0)


def test_stop_conditions_validate():
    with pytest.raises(TypeError, match="tuple of strings"):
        StopConditions(stop_strings="</tool_call>")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        StopConditions(max_turns=0)


# A Qwen2.5-style chat template (tool schemas in the system turn, consecutive tool results grouped in one user
# turn), written for this test and rendered by transformers itself.
QWEN_STYLE_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with a JSON object inside <tool_call></tool_call> tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


def test_template_mode_with_a_real_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<unk>": 0, "<|im_end|>": 1}, unk_token="<unk>")),
        eos_token="<|im_end|>",
        unk_token="<unk>",
    )
    tok.chat_template = QWEN_STYLE_TEMPLATE
    env = ToolEnv(ToolRegistry([add]), tokenizer=tok)
    assert env.mode == "template"
    obs = env.reset("What is 2 + 3?")
    assert obs.text.startswith("<|im_start|>system\n# Tools\n<tools>") and '"name": "add"' in obs.text
    assert obs.text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # The prompt, the action and the observation concatenate to what the template renders for the whole
    # conversation: the policy continues exactly the text a chat model would see.
    action = call("add", a=2, b=3)
    r = env.step(action, action_ids=None)
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": action},
            {"role": "tool", "name": "add", "content": "5"},
        ],
        tools=env.registry.schemas(),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert obs.text + action + r.observation.text == whole
    assert r.observation.text.startswith("<|im_end|>") and "<tool_response>" in r.observation.text
    r2 = env.step(action + "<|im_end|>", action_ids=[5, tok.eos_token_id])  # EOS sampled: not written twice
    assert r2.observation.text == r.observation.text[len("<|im_end|>") :]


def test_the_envs_layer_imports_no_torch():
    # Every rlbits.envs module, imported on its own (a bare ``rlbits`` package stands in for rlbits/__init__.py,
    # which re-exports the torch kernels), leaves torch and the other tensor libraries unimported.
    import subprocess
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "rlbits"
    code = (
        "import importlib, pkgutil, sys, types\n"
        f"root = types.ModuleType('rlbits'); root.__path__ = [{str(package)!r}]; sys.modules['rlbits'] = root\n"
        "import rlbits.envs\n"
        "names = [m.name for m in pkgutil.iter_modules(rlbits.envs.__path__)]\n"
        "for name in names:\n"
        "    importlib.import_module('rlbits.envs.' + name)\n"
        "heavy = [m for m in ('torch', 'tensordict', 'torchrl', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not heavy, f'importing rlbits.envs ({names}) imported {heavy}'\n"
        "assert len(names) >= 3, names\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
