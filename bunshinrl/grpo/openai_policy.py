"""OpenAIPolicy: a bunshinrl Policy backed by any OpenAI-compatible chat-completions server.

This is how a vLLM (or SGLang) server is used for rollouts: the trajectory becomes a chat (the
task prompt, then one assistant tool call and one tool message per step), the task's tools are
offered as function schemas, and the reply is either a tool call or a final answer. Every
request carries a seed derived from the decision it stands for, so a server that honours seeds
samples the same trajectory whatever the engine's scheduling, and asks for log-probs, which are
kept as the behaviour log-probs the trainer compares with its own.

Plain urllib, no SDK: the client runs wherever bunshinrl runs. Constrained decoding is requested
with vLLM's `guided_choice` extension (the task's candidate action texts) when constrain=True;
a reply in `content` is parsed as an action text, so a vLLM server answering a guided choice in
content and a server answering with tool_calls both work.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from .._async import run_blocking
from ..adapters.openai_tools import tool_schemas
from ..policy import Action, FinalAnswer, SampleContext, Step
from ..signature import ToolCall
from .actions import parse_action
from .rollout import sample_seed
from .tasks import VerifiableTask

SYSTEM_PROMPT = ("You operate a Linux workspace through tools. Call one tool at a time. When the task is "
                 "done, reply without a tool call.")


def chat_messages(prompt: str, history: Sequence[Step], system: str | None = SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The trajectory so far as chat-completions messages."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": prompt})
    for i, s in enumerate(history):
        cid = f"call_{i}"
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function",
             "function": {"name": s.call.name, "arguments": s.call.canonical_args}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": s.observation})
    return msgs


def parse_reply(message: Mapping[str, Any]) -> Action:
    """A chat-completions assistant message as an action: its first tool call, else its text."""
    calls = message.get("tool_calls") or []
    if calls:
        fn = calls[0].get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args) if isinstance(args, str) else dict(args)
        except json.JSONDecodeError:
            # A malformed call is still the model's action; the engine reports the failure to it.
            parsed = {"_unparsed": args}
        return ToolCall(str(fn.get("name") or "unnamed"), parsed if isinstance(parsed, dict) else {"_value": parsed})
    return parse_action(message.get("content") or "")


class OpenAIError(RuntimeError):
    pass


class OpenAIPolicy:
    """Rollouts from `model` on the server at `base_url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(self, base_url: str, model: str, tasks: Sequence[VerifiableTask] | Mapping[str, VerifiableTask], *,
                 api_key: str | None = None, seed: int = 0, temperature: float = 1.0, constrain: bool = True,
                 timeout: float = 60.0, max_retries: int = 3, max_tokens: int = 256) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.tasks = dict(tasks) if isinstance(tasks, Mapping) else {t.id: t for t in tasks}
        self.api_key = api_key
        self.seed = seed
        self.temperature = temperature
        self.constrain = constrain
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_tokens = max_tokens
        self._schemas = {k: tool_schemas(t.agent_tools) for k, t in self.tasks.items()}
        self._behaviour: dict[tuple[int, str, int, int], float] = {}
        self._lock = threading.Lock()
        self.requests = 0

    def request_body(self, ctx: SampleContext, history: Sequence[Step]) -> dict[str, Any]:
        task = self.tasks[ctx.task_id]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": chat_messages(ctx.prompt or task.prompt, history),
            "tools": self._schemas[ctx.task_id],
            "tool_choice": "auto",
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "n": 1,
            "seed": sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history)),
            "logprobs": True,
        }
        if self.constrain:
            body["guided_choice"] = list(task.actions)
        return body

    def _post(self, body: Mapping[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code < 500 and e.code != 429:
                    raise OpenAIError(f"{self.url}: HTTP {e.code}: {detail}") from None
                last = OpenAIError(f"{self.url}: HTTP {e.code}: {detail}")
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                last = e
            time.sleep(min(2.0, 0.1 * 2**attempt))  # overloaded or restarting: back off, then retry
        raise OpenAIError(f"{self.url}: no answer after {self.max_retries + 1} attempts: {last!r}")

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        body = self.request_body(ctx, history)
        reply = await run_blocking(self._post, body)
        with self._lock:
            self.requests += 1
        try:
            choice = reply["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise OpenAIError(f"malformed reply: {json.dumps(reply)[:300]}") from None
        lp = (choice.get("logprobs") or {}).get("content")
        if lp:
            with self._lock:
                self._behaviour[(ctx.epoch, ctx.task_id, ctx.sample, len(history))] = sum(
                    float(t["logprob"]) for t in lp)
        action = parse_reply(message)
        return action if isinstance(action, ToolCall) else FinalAnswer(action.text)

    def behaviour_logprobs(self, epoch: int) -> dict[tuple[str, int, int], float]:
        """(task, sample, step) -> the server's log-probability of each action of `epoch`."""
        with self._lock:
            keys = [k for k in self._behaviour if k[0] == epoch]
            return {k[1:]: self._behaviour.pop(k) for k in keys}
