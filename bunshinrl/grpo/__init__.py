"""GRPO training on bunshinrl rollouts: a verifiable task suite, policy backends and a trainer.

    from bunshinrl.grpo import GRPOConfig, GRPOTrainer, TorchPolicy, suite
    tasks = suite()
    trainer = GRPOTrainer(TorchPolicy.for_tasks(tasks), tasks, engine="Full")
    history = trainer.run(epochs=6)

torch is imported only by what needs it (TorchPolicy, GRPOTrainer, the local OpenAI-compatible
server), on first use, so `import bunshinrl` and the task suite, the adapters and OpenAIPolicy
work without torch installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .actions import FINAL, action_text, parse_action
from .openai_policy import OpenAIPolicy
from .rollout import (
    CONFIGS,
    EngineBundle,
    Episode,
    HarnessPolicy,
    RandomPolicy,
    episodes,
    make_engine,
    sample_seed,
    trajectory_digest,
)
from .tasks import REWARD_TOOL, VerifiableTask, files_task, fix_task, parse_reward, service_task, suite
from .vllm_policy import BackendUnavailable, VLLMPolicy, vllm_available

if TYPE_CHECKING:
    from .server import OpenAICompatServer
    from .torch_policy import PolicyConfig, TorchPolicy
    from .trainer import GRPOConfig, GRPOTrainer, StepMetrics

_LAZY = {
    "TorchPolicy": "torch_policy", "PolicyConfig": "torch_policy",
    "GRPOTrainer": "trainer", "GRPOConfig": "trainer", "StepMetrics": "trainer",
    "OpenAICompatServer": "server",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)


__all__ = [
    "CONFIGS", "FINAL", "REWARD_TOOL", "BackendUnavailable", "EngineBundle", "Episode", "GRPOConfig", "GRPOTrainer",
    "HarnessPolicy", "OpenAICompatServer", "OpenAIPolicy", "PolicyConfig", "RandomPolicy", "StepMetrics",
    "TorchPolicy", "VLLMPolicy", "VerifiableTask", "action_text", "episodes", "files_task", "fix_task",
    "make_engine", "parse_action", "parse_reward", "sample_seed", "service_task", "suite", "trajectory_digest",
    "vllm_available",
]
