"""Environments for multi-turn episodes: the interface (``base``), tool calling (``tools``) and a sandboxed
Python / exact calculator tool (``sandbox``). Plain Python, no torch. See ``docs/envs.md``."""

from rlbits.envs.base import Env, Observation, StepResult, StopConditions, map_ordered, step_all
from rlbits.envs.sandbox import SandboxResult, calculator, python, run_python
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
    "Env",
    "Observation",
    "SandboxResult",
    "StepResult",
    "StopConditions",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolFormat",
    "ToolRegistry",
    "ToolResult",
    "calculator",
    "map_ordered",
    "parse_tool_calls",
    "plain_tools_prompt",
    "python",
    "run_python",
    "step_all",
    "template_has_tools",
]
