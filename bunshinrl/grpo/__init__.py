"""GRPO training of a real language model on bunshinrl rollouts: a verifiable task suite, rollout
backends (Hugging Face in process, a vLLM server), token-level GRPO and weight sync.

    from bunshinrl.grpo import GRPOConfig, GRPOTrainer, HFPolicy, suite, testmodel
    tasks = suite()
    policy = HFPolicy.from_pretrained(testmodel.make("tiny-model"), tasks)
    history = GRPOTrainer(policy, tasks, engine="Full").run(epochs=6)

torch and transformers are imported only by what needs them (HFPolicy, GRPOTrainer, the test
model), on first use, so `import bunshinrl`, the task suite, the adapters, OpenAIPolicy and
VLLMServer work without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .actions import FINAL, action_text, parse_action
from .chat import INVALID_TOOL, candidate_replies, messages, parse_message, parse_reply, render_call
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
from .sync import InProcessSync, VLLMServerSync, WeightSync, WeightSyncError
from .tasks import REWARD_TOOL, VerifiableTask, files_task, fix_task, parse_reward, service_task, suite
from .turns import Turn
from .vllm_policy import BackendUnavailable, VLLMPolicy, vllm_available
from .vllm_server import VLLMServer, VLLMServerError

if TYPE_CHECKING:
    from .hf_policy import HFPolicy
    from .trainer import GRPOConfig, GRPOTrainer, StepMetrics

_LAZY = {
    "HFPolicy": "hf_policy",
    "GRPOTrainer": "trainer", "GRPOConfig": "trainer", "StepMetrics": "trainer",
}


def __getattr__(name: str) -> Any:
    if name == "testmodel":
        return importlib.import_module(f".{name}", __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)


__all__ = [
    "CONFIGS", "FINAL", "INVALID_TOOL", "REWARD_TOOL", "BackendUnavailable", "EngineBundle", "Episode", "GRPOConfig",
    "GRPOTrainer", "HFPolicy", "HarnessPolicy", "InProcessSync", "OpenAIPolicy", "RandomPolicy", "StepMetrics", "Turn",
    "VLLMPolicy", "VLLMServer", "VLLMServerError", "VLLMServerSync", "VerifiableTask", "WeightSync", "WeightSyncError",
    "action_text", "candidate_replies", "episodes", "files_task", "fix_task", "make_engine", "messages",
    "parse_action", "parse_message", "parse_reply", "parse_reward", "render_call", "sample_seed", "service_task",
    "suite", "trajectory_digest", "vllm_available",
]
