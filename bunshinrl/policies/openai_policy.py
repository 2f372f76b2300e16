"""OpenAIPolicy: rollouts from an OpenAI-compatible chat-completions server (vLLM), through the
official `openai` SDK (AsyncOpenAI).

Every decision is one request, awaited on the engine's event loop, so all of a group's samples
have requests in flight at once and the server batches them. A request carries:
- the trajectory as chat messages (chat.messages) and the task's tools as function schemas,
  with `tool_choice="auto"` (vLLM needs --enable-auto-tool-choice and a --tool-call-parser,
  which VLLMServer passes) and `parallel_tool_calls` (on by default: the calls of one reply run
  in order, each answered by its own tool message);
- the decision's own seed (seeds.sample_seed), so the same weights and history sample the
  same reply however the engine schedules rollouts (on vLLM, bit-identical only with one
  sequence at a time: batch composition changes CPU numerics);
- `max_completion_tokens`, plain sampling (top_p=1, top_k=0: a server's defaults from the
  model's generation_config.json never narrow the distribution behind the learner's back);
- `logprobs` and vLLM's `return_token_ids`: the prompt ids the server rendered and the reply's
  ids with their log-probs are recorded as a Turn, which the learner trains on;
- with constrain=True, vLLM's `structured_outputs={"choice": [...]}`: the reply is one of the
  task's candidate calls (vLLM >= 0.12 ignores the old `guided_choice`).
The reply is the server's parsed tool call, or its text parsed as in chat.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from openai import AsyncOpenAI

from ..calls.policy import Action, SampleContext, Step
from ..calls.replies import parse_message
from ..calls.task import Task
from .chat import SYSTEM_PROMPT, candidate_replies, messages
from .seeds import sample_seed
from .turns import Turn, TurnKey, TurnLog


class OpenAIPolicyError(RuntimeError):
    pass


class OpenAIClient:
    """The openai SDK's AsyncOpenAI for a server, one per event loop (its connections belong to
    the loop that opened them). Every bunshinrl caller of an OpenAI-compatible server (this
    policy, verl's server client in bunshinrl.adapters.verl) goes through it."""

    def __init__(self, base_url: str, *, api_key: str = "EMPTY", timeout: float = 120.0, max_retries: int = 2) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self._client: tuple[asyncio.AbstractEventLoop, AsyncOpenAI] | None = None

    def __call__(self) -> AsyncOpenAI:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            self._client = (loop, AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout,
                                              max_retries=self.max_retries))
        return self._client[1]

    async def aclose(self) -> None:
        """Close the client of the running loop (its connections cannot outlive the loop)."""
        if self._client is not None and self._client[0] is asyncio.get_running_loop():
            await self._client[1].close()
        self._client = None


class OpenAIPolicy:
    """Rollouts from `model` on the server at `base_url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(self, base_url: str, model: str, tasks: Sequence[Task] | Mapping[str, Task], *,
                 api_key: str = "EMPTY", seed: int = 0, temperature: float = 1.0, constrain: bool = False,
                 max_completion_tokens: int = 256, system: str | None = SYSTEM_PROMPT, timeout: float = 120.0,
                 max_retries: int = 2, extra_body: Mapping[str, Any] | None = None,
                 parallel_tool_calls: bool = True) -> None:
        self.base_url = base_url
        self.model = model
        self.tasks = dict(tasks) if isinstance(tasks, Mapping) else {t.id: t for t in tasks}
        self.api_key = api_key
        self.seed = seed
        self.temperature = temperature
        self.constrain = constrain
        self.max_completion_tokens = max_completion_tokens
        self.system = system
        self.timeout = timeout
        self.max_retries = max_retries
        self.extra_body = dict(extra_body or {})
        self.parallel_tool_calls = parallel_tool_calls
        self.weight_version = ""  # what the server serves, as the last weight sync set it
        self._schemas = {k: t.agent_tools.schemas() for k, t in self.tasks.items()}
        self.client = OpenAIClient(base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self.turns = TurnLog()
        self.requests = 0

    async def aclose(self) -> None:
        await self.client.aclose()

    def choices(self, task_id: str) -> tuple[str, ...] | None:
        return candidate_replies(self.tasks[task_id]) if self.constrain else None

    def request(self, ctx: SampleContext, history: Sequence[Step]) -> dict[str, Any]:
        """The keyword arguments of chat.completions.create for this decision."""
        task = self.tasks[ctx.task_id]
        extra: dict[str, Any] = {"top_k": 0, "return_token_ids": True, **self.extra_body}
        choices = self.choices(ctx.task_id)
        if choices is not None:
            extra["structured_outputs"] = {"choice": list(choices)}
        return {
            "model": self.model,
            "messages": messages(ctx.prompt or task.prompt, history, self.system),
            "tools": self._schemas[ctx.task_id],
            "tool_choice": "auto",
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature,
            "top_p": 1.0,
            "max_completion_tokens": self.max_completion_tokens,
            "seed": sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history)),
            "logprobs": True,
            "n": 1,
            "extra_body": extra,
        }

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        kwargs = self.request(ctx, history)
        reply = await self.client().chat.completions.create(**kwargs)
        self.requests += 1
        if not reply.choices:
            raise OpenAIPolicyError(f"{self.base_url}: a reply without choices: {reply!r:.300}")
        choice = reply.choices[0]
        turn = self._turn(reply, choice, kwargs["extra_body"].get("structured_outputs"))
        if turn is not None:
            self.turns.record(ctx.epoch, ctx.task_id, ctx.sample, len(history), turn)
        return parse_message(choice.message.model_dump(), self.tasks[ctx.task_id].agent_tools,
                             parallel=self.parallel_tool_calls)

    def _turn(self, reply: Any, choice: Any, structured: Mapping[str, Any] | None) -> Turn | None:
        """The decision as trained on, from vLLM's extensions (None from a server without them)."""
        prompt_ids = getattr(reply, "prompt_token_ids", None)
        ids = getattr(choice, "token_ids", None)
        content = getattr(choice.logprobs, "content", None) if choice.logprobs is not None else None
        if prompt_ids is None or ids is None or content is None:
            return None
        logps = [float(t.logprob) for t in content]
        if len(logps) != len(ids):
            raise OpenAIPolicyError(f"{len(logps)} log-probs for {len(ids)} tokens in a reply")
        choices = tuple(structured["choice"]) if structured else None
        return Turn(tuple(prompt_ids), tuple(ids), tuple(logps), choices, self.weight_version,
                    choice.finish_reason or "")

    def take_turns(self, epoch: int) -> dict[TurnKey, Turn]:
        return self.turns.take(epoch)


__all__ = ["OpenAIClient", "OpenAIPolicy", "OpenAIPolicyError"]
