"""GRPO training of a real language model on bunshinrl rollouts: a verifiable task suite, the
episodes a trainer sees (`make_engine("Base" / "Spec" / "Full")`), token-level GRPO, weight sync,
and the test model. The LLM policies it trains live in bunshinrl.policies; this face re-exports
them, as `bunshinrl.grpo` (the name of this package before it had folders) still does.

    from bunshinrl.training import GRPOConfig, GRPOTrainer, HFPolicy, suite, testmodel
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

from ..calls.replies import parse_message, parse_reply, render_call
from ..calls.task import INVALID_TOOL, REWARD_TOOL, parse_reward
from ..policies.actions import FINAL, action_text, from_text
from ..policies.chat import candidate_replies, messages
from ..policies.openai_policy import OpenAIPolicy
from ..policies.seeds import sample_seed
from ..policies.turns import Turn
from ..policies.vllm_policy import BackendUnavailable, VLLMPolicy, vllm_available
from ..policies.vllm_server import VLLMServer, VLLMServerError
from .episodes import CONFIGS, EngineBundle, Episode, RandomPolicy, episodes, make_engine, trajectory_digest
from .sync import InProcessSync, VLLMServerSync, WeightSync, WeightSyncError
from .tasks import files_task, fix_task, service_task, suite

if TYPE_CHECKING:
    from ..policies.hf_policy import HFPolicy
    from .trainer import GRPOConfig, GRPOTrainer, StepMetrics

# Imported on first use: they need torch and transformers.
_LAZY = {
    "HFPolicy": "..policies.hf_policy",
    "GRPOTrainer": ".trainer", "GRPOConfig": ".trainer", "StepMetrics": ".trainer",
    "testmodel": ".testmodel", "experiment": ".experiment",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(mod, __name__)
    return module if name in ("testmodel", "experiment") else getattr(module, name)


__all__ = [
    "CONFIGS", "FINAL", "INVALID_TOOL", "REWARD_TOOL", "BackendUnavailable", "EngineBundle", "Episode", "GRPOConfig",
    "GRPOTrainer", "HFPolicy", "InProcessSync", "OpenAIPolicy", "RandomPolicy", "StepMetrics", "Turn",
    "VLLMPolicy", "VLLMServer", "VLLMServerError", "VLLMServerSync", "WeightSync", "WeightSyncError",
    "action_text", "candidate_replies", "episodes", "files_task", "fix_task", "from_text", "make_engine", "messages",
    "parse_message", "parse_reply", "parse_reward", "render_call", "sample_seed", "service_task",
    "suite", "trajectory_digest", "vllm_available",
]
