"""Environments for multi-turn episodes: the interface (``base``), tool calling (``tools``) and a sandboxed
Python / exact calculator tool (``sandbox``), plain Python without torch; and the torchrl adapter
(``torchrl_adapter``: torchrl ``History`` conversations into rlbits batches), imported on first use so that
``import rlbits.envs`` stays free of torch and torchrl. See ``docs/envs.md``."""

import importlib

from rlbits.envs.base import Env, Observation, StepResult, StopConditions, map_ordered, step_all
from rlbits.envs.sandbox import (
    SANDBOXES,
    SandboxResult,
    SandboxUnavailableError,
    calculator,
    check_sandbox,
    python,
    python_tool,
    run_python,
)
from rlbits.envs.tools import (
    HERMES,
    Tool,
    ToolCall,
    ToolEnv,
    ToolFormat,
    ToolRegistry,
    ToolResult,
    parse_tool_calls,
    plain_tools_prompt,
    template_has_tools,
)

# The torchrl adapter needs torch, tensordict and torchrl: imported on first attribute access.
_LAZY = {
    "episode_buffer": "rlbits.envs.torchrl_adapter",
    "episode_to_batch": "rlbits.envs.torchrl_adapter",
    "history_to_batch": "rlbits.envs.torchrl_adapter",
}

__all__ = [
    "HERMES",
    "SANDBOXES",
    "Env",
    "Observation",
    "SandboxResult",
    "SandboxUnavailableError",
    "StepResult",
    "StopConditions",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolFormat",
    "ToolRegistry",
    "ToolResult",
    "calculator",
    "check_sandbox",
    "episode_buffer",
    "episode_to_batch",
    "history_to_batch",
    "map_ordered",
    "parse_tool_calls",
    "plain_tools_prompt",
    "python",
    "python_tool",
    "run_python",
    "step_all",
    "template_has_tools",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlbits.envs' has no attribute {name!r}")
