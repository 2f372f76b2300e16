"""Task environments on the workspace templates: a desktop (GUI) task and a web-shop task.

Each factory returns a bunshinrl Task: how to build the initial workspace (spec + setup), the
tools an agent may call (each an OpenAI function schema plus a callable), and a verifiable
reward read from the workspace's real state (a file on disk, rows in PostgreSQL), never the
transcript. They run under RolloutEngine, verl's agent loop or SkyRL's env like any other task.

Typical use with live forks by hand: build one workspace with task.create(), fork it once per
rollout, let each rollout call tools on its clone (task.call(clone, "click", x=..., y=...)),
score the clone with task.reward(clone).
"""

from ..calls.task import Task

__all__ = ["Task"]
