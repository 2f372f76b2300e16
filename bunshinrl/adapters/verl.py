"""verl's async BaseTool contract on bunshinrl workspaces.

verl builds one tool object per tool name from its YAML config, `cls(config, tool_schema)`, and
its agent loop calls, for every single tool call:

    instance_id, _ = await tool.create(create_kwargs=...)
    response, step_reward, metrics = await tool.execute(instance_id, args, agent_data=...)
    await tool.release(instance_id)

(older rollouts call create once per request with instance_id=request_id and release at the
end). An agent's workspace must outlive all of that: files written by write_file must be there
for the next shell call. So instances are only handles; the workspace belongs to the trajectory,
keyed by, in order: an explicit `trajectory_id` (execute kwargs, then create_kwargs), the agent
loop's `agent_data.request_id`, `request_id` / `session_id` in create_kwargs, the instance id
given to create(). Each trajectory's workspace is a fork of its task's initialized workspace
(TrajectoryWorkspaces), held while any instance is open and destroyed once none has been open
for linger_seconds, or at once by finish(trajectory_id) / calc_reward(..., finish=True).

verl is not imported: ToolResponse below has the attributes verl reads (text, image, video),
and the schema is the plain OpenAI function dict verl's OpenAIFunctionToolSchema validates.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._async import run_blocking
from .openai_tools import is_hidden, tool_schema, validate_args
from .workspaces import TrajectoryWorkspaces

log = logging.getLogger(__name__)

_KEY_FIELDS = ("trajectory_id", "request_id", "session_id")


@dataclass
class ToolResponse:
    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


@dataclass
class _Instance:
    task_id: str
    key: str | None  # bound at create when known, else at the first execute
    explicit: bool  # created with instance_id=...: that id names the trajectory
    held: bool = False


class BunshinVerlTool:
    """One tool of a bunshinrl task, as a verl BaseTool.

    config: {"task": task id (the built-in suite's, or one registered with the pool),
             "tool": tool name (default: tool_schema's function name)}.
    """

    def __init__(self, config: Mapping[str, Any], tool_schema_: Mapping[str, Any] | None = None, *,
                 pool: TrajectoryWorkspaces | None = None) -> None:
        self.config = dict(config)
        self.pool = pool or TrajectoryWorkspaces.shared()
        task_id = self.config.get("task")
        if not task_id:
            raise ValueError("config needs 'task': the id of the task whose tools this is")
        self.task_id = str(task_id)
        task = self.pool.task(self.task_id)
        name = self.config.get("tool") or ((tool_schema_ or {}).get("function") or {}).get("name")
        if not name:
            raise ValueError("config needs 'tool' (or a tool_schema naming the function)")
        if is_hidden(str(name)):
            raise ValueError(f"{name!r} is the harness's own tool and is never offered to a model")
        self.tool = task.agent_tools[str(name)]
        self.name = self.tool.name
        self.tool_schema = dict(tool_schema_) if tool_schema_ else tool_schema(self.tool)
        self._instances: dict[str, _Instance] = {}
        self._lock = threading.Lock()
        self._warned = False

    def get_openai_tool_schema(self) -> dict[str, Any]:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        create_kwargs = dict(kwargs.pop("create_kwargs", None) or {})
        create_kwargs.update(kwargs)
        task_id = str(create_kwargs.get("task_id") or create_kwargs.get("task") or self.task_id)
        explicit = instance_id is not None
        key = next((str(create_kwargs[f]) for f in _KEY_FIELDS if create_kwargs.get(f)), None)
        if key is None and explicit:
            key = instance_id
        iid = instance_id or f"inst-{uuid.uuid4().hex}"
        with self._lock:
            self._instances[iid] = _Instance(task_id, key, explicit)
        return iid, ToolResponse()

    def _bind(self, instance_id: str, kwargs: Mapping[str, Any]) -> _Instance:
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}: create() it first")
        explicit = kwargs.get("trajectory_id")
        agent_data = kwargs.get("agent_data")
        from_agent = getattr(agent_data, "request_id", None) if agent_data is not None else None
        key = str(explicit) if explicit else inst.key or (str(from_agent) if from_agent else None)
        if key is None:
            if not self._warned:
                log.warning("no trajectory id for tool %s: its workspace lasts one call (pass trajectory_id "
                            "or agent_data)", self.name)
                self._warned = True
            key = instance_id
        if inst.key is not None and inst.key != key:
            raise ValueError(f"instance {instance_id!r} belongs to trajectory {inst.key!r}, not {key!r}")
        inst.key = key
        return inst

    async def execute(self, instance_id: str, parameters: Mapping[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        inst = self._bind(instance_id, kwargs)
        assert inst.key is not None
        if not inst.held:
            await self.pool.acquire(inst.key, inst.task_id)
            inst.held = True
        ws = self.pool.get(inst.key)
        assert ws is not None
        problem = validate_args(self.tool, parameters)
        if problem is not None:
            return ToolResponse(text=f"[error] {problem}"), 0.0, {"trajectory_id": inst.key, "valid": False}
        text = await self.tool.run(ws, parameters)
        return ToolResponse(text=text), 0.0, {"trajectory_id": inst.key, "valid": True}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The task's verifier on the trajectory's current workspace; finish=True then ends the
        trajectory (its workspace is destroyed)."""
        inst = self._bind(instance_id, kwargs)
        assert inst.key is not None
        ws = self.pool.get(inst.key)
        if ws is None:
            ws = await self.pool.acquire(inst.key, inst.task_id)
            inst.held = True
        score, _detail = await run_blocking(self.pool.task(inst.task_id).verify, ws)
        if kwargs.get("finish"):
            await self.finish(inst.key)
        return float(score)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        with self._lock:
            inst = self._instances.pop(instance_id, None)
        if inst is None or inst.key is None or not inst.held:
            return
        await self.pool.release(inst.key)
        if inst.key == instance_id and not inst.explicit:
            # Nothing named a trajectory: this instance was its only user.
            await self.pool.finish(inst.key)

    async def finish(self, trajectory_id: str) -> None:
        await self.pool.finish(trajectory_id)
