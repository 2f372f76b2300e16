"""bunshinrl inside SkyRL: a skyrl_gym text environment whose steps run on bunshinrl's rollout core.

    import bunshinrl.adapters.skyrl  # registers "bunshin-workspace" with skyrl_gym
    env = skyrl_gym.make("bunshin-workspace", env_config={"task": "fix-both"}, extras={"max_turns": 4})

SkyRL's generator makes one env per trajectory, calls `init(prompt)`, `step(llm_output)` until
`done`, `get_metrics()` at the episode's end, then `close()`, and aggregates every episode's
metrics with the env class's `aggregate_metrics`. Here the trajectory is a Rollout
(bunshinrl.rollout.core): a step parses the model's tool call(s) (Hermes `<tool_call>` blocks or bare
JSON; several are run in order), serves each from a speculative branch that predicted it, from
the prefix cache, or runs it for real, and returns the observations. The episode ends when the
model answers without a tool call or its budget is spent; the task's verifier then scores the
final workspace state as the step's reward.

Validate, then serve. SkyRL's generator owns the conversation: an observation returned by step()
is in it for good, so a trajectory cannot be rewound to a served step that does not reproduce.
The env's runtime therefore runs with `validate_hits`: a cache hit's call is first run on the
sample's own workspace and compared with what was recorded, and that fresh observation is what the
model gets (equal: the sample stays on the prefix tree; different: the tool's cached subtrees are
dropped and the sample goes on off the tree). Nothing the model sees came from another workspace.
get_metrics counts `validated` (hits served after their replay matched) and `divergences` (those
whose replay differed, besides the core's own).

step() is synchronous (SkyRL runs it inline or on its env executor): it waits on the runtime's
one loop thread, where every rollout, capture and speculative chain of the process runs, so a
predicted call keeps running there while SkyRL's model generates. No thread is spawned per call.
This is bunshinrl's one bridge from synchronous code, and it is SkyRL's API that needs it: its
generator calls `env.step()` synchronously and expects the observation as the return value, so
the step must block its caller while the rollout's asyncio work (AsyncWorkspace commands, forks)
runs on the loop thread. verl's tool and agent loop are async and await the core directly.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from ..calls.policy import FinalAnswer, calls_of
from ..calls.replies import parse_reply
from ..calls.task import INVALID_TOOL, Task
from ..rollout.core import Rollout
from .runtime import Runtime, plain, resolve_task, rollout_metrics, task_options

ENV_ID = "bunshin-workspace"

_TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor "
                 "each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}}\n</tool_call>")


def tools_prompt(task: Task) -> str:
    """The task's tools as Hermes/Qwen chat templates present them to a model."""
    return _TOOLS_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in task.agent_tools.schemas()))


class BunshinEnv(BaseTextEnv):
    """env_config: "task" (a task id or "module:attribute"), "template" (WorkspaceSpec fields),
    "runtime" (RuntimeConfig fields of the process-wide runtime), "tools_in_prompt" (default
    True: init() adds the tool schemas to the system message, since SkyRL renders the chat
    without tools), "observation_role" ("tool" by default). extras (a dataset row's): "task"
    overrides env_config's; "max_turns" (SkyRL's generator sets it) caps the task's budget;
    "group" names the GRPO group (its samples fork one snapshot)."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        cfg, ext = plain(env_config), plain(extras)
        name, template = task_options({**cfg, **{k: ext[k] for k in ("task", "template") if k in ext}})
        self.task = resolve_task(name, template)
        self.runtime = Runtime.shared({**plain(cfg.get("runtime")), "validate_hits": True})
        self.max_turns = min(int(ext.get("max_turns") or self.task.budget), self.task.budget)
        self.group = str(ext["group"]) if ext.get("group") is not None else None
        self.tools_in_prompt = bool(cfg.get("tools_in_prompt", True))
        self.observation_role = str(cfg.get("observation_role", "tool"))
        self.trajectory_id = f"skyrl-{uuid.uuid4().hex}"
        self.rollout: Rollout | None = None
        self._ended = False
        self.validated = 0  # cache hits served after their replay on this sample's workspace matched
        self.diverged = 0  # cache hits whose replay there observed something else (not served)

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.rollout = self.runtime.run(self.runtime.start(self.trajectory_id, self.task, group=self.group))
        chat = [dict(m) for m in prompt]
        if self.tools_in_prompt:
            tools = tools_prompt(self.task)
            if chat and chat[0].get("role") == "system":
                chat[0]["content"] = f"{chat[0].get('content') or ''}\n\n{tools}".lstrip()
            else:
                chat.insert(0, {"role": "system", "content": tools})
        return chat, {"task_id": self.task.id, "trajectory_id": self.trajectory_id, "max_turns": self.max_turns,
                      "tools": self.task.agent_tools.schemas()}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        r = self.rollout
        if r is None or self._ended:
            raise RuntimeError("step() before init() or after the episode ended")
        self.turns += 1
        parsed = parse_reply(action, self.task.agent_tools)
        if isinstance(parsed, FinalAnswer):
            return self._end([], parsed.text)
        calls = calls_of(parsed)[:r.calls_left]
        if not calls:
            return self._end([], None)
        observations = self.runtime.run(self._run(r, calls))
        messages = [{"role": "user" if c.name == INVALID_TOOL else self.observation_role, "content": o}
                    for c, o in zip(calls, observations, strict=True)]
        if self.turns >= self.max_turns or r.calls_left == 0:
            return self._end(messages, None)
        return BaseTextEnvStepOutput(observations=messages, reward=0.0, done=False,
                                     metadata={"turn": self.turns, "served": r.served[-len(calls):]},
                                     postprocessed_action=None)

    async def _run(self, r: Rollout, calls: tuple[Any, ...]) -> list[str]:
        decision = len(r.history)
        out = []
        for c in calls:
            audits = r.timeline.count("audit")
            out.append(await r.call(c, decision))
            if r.timeline.count("audit") > audits:
                # The call was a hit, re-run here before serving (validate_hits): the sample
                # stays on the tree only when it observed what the hit recorded.
                if r.node is not None:
                    self.validated += 1
                else:
                    self.diverged += 1
        return out

    def _end(self, messages: list[dict[str, Any]], answer: str | None) -> BaseTextEnvStepOutput:
        self._ended = True
        r = self.runtime.run(self.runtime.end(self.trajectory_id, answer))
        reward = float(r.reward) if r is not None and r.reward is not None else 0.0
        return BaseTextEnvStepOutput(observations=messages, reward=reward, done=True,
                                     metadata={"turn": self.turns, "verdict": r.verdict if r is not None else None},
                                     postprocessed_action=None)

    def get_metrics(self) -> dict[str, Any]:
        if self.rollout is None:
            return {}
        m = rollout_metrics(self.rollout)
        m["reward"] = m["reward"] if m["reward"] is not None else 0.0
        m["validated"] = self.validated
        m["divergences"] += self.diverged
        return m

    @staticmethod
    def aggregate_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
        """Totals of the per-path call counts over the episodes, the mean reward, and the share of
        calls served without running them (cache hits and adopted speculation)."""
        if not metrics:
            return {}
        keys = ("tool_calls", "executed", "cache_hits", "spec_hits", "rejected", "spec_misses", "errors",
                "validated", "divergences", "rewound", "rerolled")
        out: dict[str, Any] = {k: sum(int(m.get(k, 0)) for m in metrics) for k in keys}
        out["reward"] = sum(float(m.get("reward") or 0.0) for m in metrics) / len(metrics)
        out["served_without_running"] = (out["cache_hits"] + out["spec_hits"]) / out["tool_calls"] \
            if out["tool_calls"] else 0.0
        out["validated_share"] = out["validated"] / out["tool_calls"] if out["tool_calls"] else 0.0
        out["episodes"] = len(metrics)
        return out

    def close(self) -> None:
        if self.rollout is not None and not self._ended:
            self._ended = True
            self.runtime.run(self.runtime.discard(self.trajectory_id))


if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:BunshinEnv")

__all__ = ["ENV_ID", "BunshinEnv", "tools_prompt"]
