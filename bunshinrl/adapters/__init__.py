"""bunshinrl inside other RL frameworks, through their own entry points.

- verl (bunshinrl.adapters.verl): BunshinTool, a verl BaseTool that verl's tool registry loads
  from a tool-config YAML; BunshinAgentLoop, registered in verl's agent-loop registry as
  "bunshin_agent"; VLLMServerClient, verl's token-level server interface on a vLLM server.
- SkyRL (bunshinrl.adapters.skyrl): BunshinEnv, a skyrl_gym BaseTextEnv registered as
  "bunshin-workspace".

Both run every tool call on bunshinrl's rollout core (prefix cache, speculation, memory
sharing) through one process-wide Runtime. The framework modules import verl or skyrl_gym
themselves (install them with `pip install -e .[frameworks]`); this package imports neither.
"""

from .runtime import Runtime, RuntimeConfig, register_task, resolve_task, rollout_metrics

__all__ = ["Runtime", "RuntimeConfig", "register_task", "resolve_task", "rollout_metrics"]
