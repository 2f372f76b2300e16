"""A local OpenAI-compatible chat-completions server that serves a TorchPolicy.

It speaks the subset of the protocol a tool-calling rollout uses, the way vLLM's server does:
POST /v1/chat/completions with messages, tools, tool_choice, seed, temperature, logprobs and
vLLM's guided_choice extension; GET /v1/models. The reply is an assistant message with one
tool call (finish_reason "tool_calls") or with text (finish_reason "stop"), and the chosen
action's log-probability. It lets OpenAIPolicy, the client a vLLM deployment would use, be
exercised end to end on a CPU; it binds 127.0.0.1 only and is not meant as a production server.

The server serves the very TorchPolicy object it was given, so after a training update the next
request samples from the new weights (what a weight sync does for a separate inference server).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..signature import ToolCall
from .actions import FINAL
from .torch_policy import TorchPolicy


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def conversation(messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    """(task prompt, [(action text, observation)]) from a chat: the first user message is the
    prompt; each assistant tool call is answered by the tool message carrying its id."""
    prompt: str | None = None
    steps: list[tuple[str, str]] = []
    pending: dict[str, str] = {}
    for m in messages:
        role = m.get("role")
        if role == "user" and prompt is None:
            prompt = str(m.get("content") or "")
        elif role == "assistant":
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or {}
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                    pending[str(tc.get("id"))] = ToolCall(str(fn.get("name")), args).key
                except (ValueError, TypeError) as e:
                    raise BadRequest(f"unparseable tool call in the history: {e}") from None
        elif role == "tool":
            cid = str(m.get("tool_call_id"))
            if cid not in pending:
                raise BadRequest(f"tool message answers unknown tool_call_id {cid!r}")
            steps.append((pending.pop(cid), str(m.get("content") or "")))
    if prompt is None:
        raise BadRequest("messages must contain a user message (the task prompt)")
    return prompt, steps


class OpenAICompatServer:
    """Serve `policy` as model `model` on 127.0.0.1:`port` (0: any free port)."""

    def __init__(self, policy: TorchPolicy, *, model: str = "bunshin-tiny", host: str = "127.0.0.1",
                 port: int = 0) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the test server binds loopback only")
        self.policy = policy
        self.model = model
        self.requests = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Mapping[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, e: BadRequest) -> None:
                self._send(e.status, {"error": {"message": str(e), "type": e.code, "code": e.status}})

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": server.model, "object": "model", "created": 0, "owned_by": "bunshin"}]})
                elif self.path == "/health":
                    self._send(200, {"ok": True})
                else:
                    self._error(BadRequest(f"no route {self.path}", 404, "not_found"))

            def do_POST(self) -> None:
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(n)
                    if self.path.rstrip("/") != "/v1/chat/completions":
                        raise BadRequest(f"no route {self.path}", 404, "not_found")
                    try:
                        body = json.loads(raw)
                    except json.JSONDecodeError as e:
                        raise BadRequest(f"invalid JSON: {e}") from None
                    self._send(200, server.complete(body))
                except BadRequest as e:
                    self._error(e)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> OpenAICompatServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="openai-compat", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> OpenAICompatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the protocol ----

    def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise BadRequest("the request body must be a JSON object")
        if body.get("model") != self.model:
            raise BadRequest(f"the model {body.get('model')!r} does not exist", 404, "model_not_found")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by this server")
        if int(body.get("n") or 1) != 1:
            raise BadRequest("only n=1 is supported")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        prompt, steps = conversation(messages)
        allowed = self._allowed(body, prompt)
        temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
        seed = body.get("seed")
        try:
            text, logp = self.policy.sample(prompt, steps, allowed, None if seed is None else int(seed), temperature)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        with self._lock:
            self.requests += 1
        if text == FINAL:
            message: dict[str, Any] = {"role": "assistant", "content": "done"}
            finish = "stop"
        else:
            call = ToolCall.from_key(text)
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                "function": {"name": call.name, "arguments": call.canonical_args}}]}
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            # One "token" per action: the constrained vocabulary's unit.
            choice["logprobs"] = {"content": [{"token": text, "logprob": logp, "bytes": None, "top_logprobs": []}]}
        prompt_tokens = len(self.policy.encode(prompt, [a for a, _ in steps], [o for _, o in steps])[0])
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1},
        }

    def _allowed(self, body: Mapping[str, Any], prompt: str) -> tuple[str, ...]:
        """The actions the reply may be: vLLM's guided_choice when given, else every known action
        of the offered tools (plus FINAL unless tool_choice demands a call)."""
        guided = body.get("guided_choice")
        if guided is not None:
            if not isinstance(guided, list) or not all(isinstance(g, str) for g in guided):
                raise BadRequest("guided_choice must be a list of strings")
            known = [g for g in guided if g in self.policy.action_index]
            if not known:
                raise BadRequest("none of guided_choice is in the model's vocabulary")
            return tuple(known)
        offered = {(t.get("function") or {}).get("name") for t in body.get("tools") or []}
        candidates = self.policy.allowed_for(prompt=prompt)
        out = [a for a in candidates if a != FINAL and ToolCall.from_key(a).name in offered]
        if body.get("tool_choice") != "required":
            out.append(FINAL)
        return tuple(out)
