"""bunshinrl's workspaces and tools behind other RL frameworks' contracts.

- verl: BunshinVerlTool, verl's async BaseTool (create / execute / calc_reward / release),
  keyed by trajectory so one workspace lives across the per-call create/release verl does.
- SkyRL-Gym: BunshinTextEnv (init / step / close), a text-in/text-out tool environment.
- OpenAI function calling: tool_schemas() for any tool set.

Neither verl nor SkyRL is imported: the classes implement their contracts structurally (the
same method names, arguments and return shapes), so they plug in where those frameworks are
installed and are tested here without them.
"""

from .openai_tools import SchemaTool, is_hidden, string_params, tool_schema, tool_schemas, validate_args
from .skyrl import BaseTextEnvStepOutput, BunshinTextEnv
from .verl import BunshinVerlTool, ToolResponse, TrajectoryWorkspaces

__all__ = [
    "BaseTextEnvStepOutput", "BunshinTextEnv", "BunshinVerlTool", "SchemaTool", "ToolResponse",
    "TrajectoryWorkspaces", "is_hidden", "string_params", "tool_schema", "tool_schemas", "validate_args",
]
