"""Environments for multi-turn episodes: the interface (``base``), tool calling (``tools``), a sandboxed
Python tool (``sandbox``) and an exact calculator tool (``calculator_tool``); plain Python without torch.
torchrl conversations become rlbits batches in ``rlbits.data.torchrl_adapter``. See ``docs/envs.md``."""

from rlbits.envs.base import Env, Observation, StepResult, StopConditions, map_ordered, step_all
from rlbits.envs.calculator_tool import calculator
from rlbits.envs.sandbox import (
    SANDBOXES,
    SandboxResult,
    SandboxUnavailableError,
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
    "map_ordered",
    "parse_tool_calls",
    "plain_tools_prompt",
    "python",
    "python_tool",
    "run_python",
    "step_all",
    "template_has_tools",
]
