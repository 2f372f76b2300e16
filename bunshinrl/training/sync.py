"""Weight sync: after every update, the rollout backend serves the trained weights, and says so.

GRPOTrainer pushes the learner's weights with a new version after each update and, before the
next rollout starts, checks that the backend reports that version: a rollout can never sample
from stale weights unnoticed.

- InProcessSync: the rollout policy is the learner itself (HFPolicy generating in process);
  the weights are already there, only the version moves.
- VLLMServerSync: a vLLM server, through vLLM's own routes (VLLM_SERVER_DEV_MODE=1). What vLLM
  0.32 offers: the RL routes move weights over NCCL or CUDA IPC (/init_weight_transfer_engine,
  /update_weights), which need GPUs on both sides; and `reload_weights` over /collective_rpc,
  which reloads the model in place from a checkpoint directory (what runs here, on CPU, and
  works on a GPU host that shares a file system with the trainer). So: save the weights as
  safetensors, /pause (mode=wait: in-flight requests finish first), /collective_rpc
  reload_weights(weights_path=...), /reset_prefix_cache (cached KV came from the old weights),
  /update_weight_version, /resume; /weight_info then reports the version.
  One limit found in vLLM 0.32: that in-place reload leaves a *tied* lm_head on the weights it
  was loaded with (the worker logs "ParallelLMHead: Failed to load weights"), so a model with
  tie_word_embeddings would be served half-updated; push() refuses such a model. Untie it
  (config tie_word_embeddings=false, lm_head.weight saved) or use vLLM's NCCL transfer on GPUs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from openai import AsyncOpenAI


class WeightSyncError(RuntimeError):
    pass


class WeightSync(Protocol):
    async def push(self, learner: Any, version: str) -> None:
        """Make the backend serve `learner`'s current weights as `version`."""
        ...

    async def served_version(self) -> str:
        """The weight version the backend serves now."""
        ...


class InProcessSync:
    """The rollout policy samples from the learner's own model object."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    async def push(self, learner: Any, version: str) -> None:
        if learner is not self.policy:
            raise WeightSyncError("InProcessSync needs the rollout policy to be the learner itself")
        self.policy.weight_version = version

    async def served_version(self) -> str:
        return str(self.policy.weight_version)


class VLLMServerSync:
    """Reload-from-checkpoint sync into a vLLM server at root_url (http://host:port).

    directory: where checkpoints are written (the server must read the same path); a private
    temporary directory by default, removed by close(). Only the newest checkpoint is kept.
    """

    def __init__(self, root_url: str, *, rollout_policy: Any | None = None,
                 directory: str | os.PathLike[str] | None = None,
                 timeout: float = 300.0) -> None:
        self.root_url = root_url.rstrip("/")
        self.rollout_policy = rollout_policy
        self._own_dir = directory is None
        self.directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="bunshin-sync-"))
        self.timeout = timeout
        self.last: Path | None = None

    def _client(self) -> AsyncOpenAI:
        # A client per call: the trainer may run successive event loops (asyncio.run per run).
        return AsyncOpenAI(base_url=self.root_url, api_key="EMPTY", timeout=self.timeout, max_retries=0)

    async def _post(self, client: AsyncOpenAI, path: str, body: Any = None,
                    params: dict[str, Any] | None = None) -> Any:
        return await client.post(path, cast_to=object, body=body, options={"params": params or {}})

    async def push(self, learner: Any, version: str) -> None:
        if getattr(getattr(learner.model, "config", None), "tie_word_embeddings", False):
            raise WeightSyncError("vLLM's reload_weights does not update a tied lm_head: the server would sample "
                                  "from half-updated weights. Untie the checkpoint (tie_word_embeddings=false).")
        ckpt = learner.save_weights(self.directory / f"v{version}")
        async with self._client() as c:
            await self._post(c, "/pause", params={"mode": "wait"})
            try:
                await self._post(c, "/collective_rpc", {"method": "reload_weights",
                                                        "kwargs": {"weights_path": str(ckpt)}})
                await self._post(c, "/reset_prefix_cache")
                await self._post(c, "/update_weight_version", {"new_version": version})
            finally:
                await self._post(c, "/resume")
        if self.last is not None and self.last != ckpt:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = ckpt
        if self.rollout_policy is not None:
            self.rollout_policy.weight_version = version

    async def served_version(self) -> str:
        async with self._client() as c:
            info = await c.get("/weight_info", cast_to=object)
        if not isinstance(info, dict) or "weight_version" not in info:
            raise WeightSyncError(f"{self.root_url}/weight_info answered {info!r}")
        return str(info["weight_version"])

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["InProcessSync", "VLLMServerSync", "WeightSync", "WeightSyncError"]
