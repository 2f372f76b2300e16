"""Policy backends: TorchPolicy (seeded, constrained, differentiable), OpenAIPolicy against the
project's own OpenAI-compatible server (same trajectories as the in-process policy), and
VLLMPolicy (skipped, with the reason, where vllm or a GPU is missing)."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from typing import Any

import pytest

from bunshinrl import SampleContext, Step, ToolCall
from bunshinrl.grpo import (
    BackendUnavailable,
    HarnessPolicy,
    OpenAIPolicy,
    VLLMPolicy,
    episodes,
    make_engine,
    suite,
    trajectory_digest,
    vllm_available,
)
from bunshinrl.grpo.actions import FINAL, parse_action
from bunshinrl.grpo.rollout import Episode

torch = pytest.importorskip("torch")

from bunshinrl.grpo.server import OpenAICompatServer  # noqa: E402
from bunshinrl.grpo.torch_policy import TorchPolicy  # noqa: E402
from bunshinrl.grpo.trainer import GRPOConfig, GRPOTrainer  # noqa: E402

TASKS = [t for t in suite() if t.id in ("files-ab", "fix-both")]
TMAP = {t.id: t for t in TASKS}


def test_sampling_is_seeded_constrained_and_matches_training_logprobs() -> None:
    p = TorchPolicy.for_tasks(suite(), seed=3)
    task = TMAP["fix-both"]
    draws = [p.sample(task.prompt, [], task.actions, seed=s) for s in range(200)]
    assert draws[:20] == [p.sample(task.prompt, [], task.actions, seed=s) for s in range(20)]
    assert {a for a, _ in draws} <= set(task.actions)
    assert len({a for a, _ in draws}) > 3  # an untrained policy explores
    probs = p.distribution(task.prompt, [], task.actions)
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-5)
    outside = [i for a, i in p.action_index.items() if a not in task.actions]
    assert float(probs[outside].sum()) == 0.0

    # The batched, differentiable log-probs the trainer uses equal the sampler's.
    steps: list[tuple[str, str]] = []
    actions, lps = [], []
    for s in range(3):
        a, lp = p.sample(task.prompt, steps, task.actions, seed=100 + s)
        actions.append(a)
        lps.append(lp)
        steps.append((a, f"observation {s}"))
    ep = Episode(task.id, 0, 0, task.prompt, tuple(actions), tuple(o for _, o in steps), 1.0)
    logp, owner = p.logprobs([ep, ep])
    assert logp.requires_grad and owner.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.allclose(logp[:3].detach(), torch.tensor(lps), atol=1e-5)

    clone = TorchPolicy.from_snapshot(p.snapshot())
    assert clone.parameters_digest() == p.parameters_digest()
    assert clone.sample(task.prompt, [], task.actions, 7) == p.sample(task.prompt, [], task.actions, 7)


def _post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_compatible_server_speaks_the_protocol() -> None:
    p = TorchPolicy.for_tasks(TASKS, seed=0)
    task = TMAP["files-ab"]
    with OpenAICompatServer(p, model="tiny") as srv:
        url = srv.base_url + "/chat/completions"
        with urllib.request.urlopen(srv.base_url + "/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny"]
        client = OpenAIPolicy(srv.base_url, "tiny", TASKS)
        body = client.request_body(SampleContext(task.id, 0, 0, task.prompt), [])
        status, reply = _post(url, body)
        assert status == 200 and reply["object"] == "chat.completion"
        choice = reply["choices"][0]
        assert choice["logprobs"]["content"][0]["logprob"] < 0
        assert choice["logprobs"]["content"][0]["token"] in task.actions
        # Same seed, same action; the reply is a tool call or, for FINAL, plain content.
        again = _post(url, body)[1]["choices"][0]
        assert again["logprobs"]["content"][0]["token"] == choice["logprobs"]["content"][0]["token"]
        # guided_choice constrains the reply; tool_choice=required rules out answering.
        only = task.actions[0]
        assert _post(url, {**body, "guided_choice": [only]})[1]["choices"][0]["logprobs"]["content"][0]["token"] == only
        no_guide = {k: v for k, v in body.items() if k != "guided_choice"}
        for s in range(30):
            c = _post(url, {**no_guide, "seed": s, "tool_choice": "required"})[1]["choices"][0]
            assert c["finish_reason"] == "tool_calls"
        # The history round-trips: a tool call and its result are part of the next context.
        step = Step(parse_action(task.solution[0]), "wrote 6 bytes to /root/out/a.txt")  # type: ignore[arg-type]
        status, _ = _post(url, client.request_body(SampleContext(task.id, 0, 0, task.prompt), [step]))
        assert status == 200
        # Errors come back in OpenAI's error shape.
        assert _post(url, b"{not json")[0] == 400
        status, err = _post(url, {**body, "model": "gpt-nothing"})
        assert status == 404 and "does not exist" in err["error"]["message"]
        assert _post(url, {**body, "stream": True})[0] == 400
        assert _post(url, {**body, "messages": [{"role": "system", "content": "x"}]})[0] == 400


def test_openai_policy_end_to_end_equals_the_in_process_policy_and_trains() -> None:
    """The OpenAI client through the engine samples exactly what TorchPolicy samples itself (same
    seeds), records the server's log-probs, and a GRPO step can roll out through it."""

    async def rollout(agent: Any) -> list[Episode]:
        bundle = make_engine("Base", HarnessPolicy(agent, TMAP), TASKS)
        try:
            return episodes(await bundle.engine.run_epoch([t.task() for t in TASKS], 3, 0), TMAP)
        finally:
            await bundle.aclose()

    learner = TorchPolicy.for_tasks(TASKS, seed=5)
    direct = asyncio.run(rollout(learner))
    direct_lp = learner.behaviour_logprobs(0)
    with OpenAICompatServer(learner, model="tiny") as srv:
        client = OpenAIPolicy(srv.base_url, "tiny", TASKS, seed=5)
        served = asyncio.run(rollout(client))
        served_lp = client.behaviour_logprobs(0)
        assert all(e.ok for e in served), [e.errors for e in served]
        assert trajectory_digest(served) == trajectory_digest(direct)
        assert served_lp.keys() == direct_lp.keys() and len(served_lp) == sum(len(e.actions) for e in served)
        assert all(abs(served_lp[k] - direct_lp[k]) < 1e-6 for k in served_lp)
        assert srv.requests == len(served_lp)

        before = learner.parameters_digest()
        trainer = GRPOTrainer(learner, TASKS, config=GRPOConfig(group_size=3, seed=5), rollout_policy=client)
        m = asyncio.run(_one_step(trainer))
        assert m.logprob_drift is not None and m.logprob_drift < 1e-4
        assert learner.parameters_digest() != before  # the served weights are the trained ones


async def _one_step(trainer: GRPOTrainer) -> Any:
    try:
        return await trainer.step()
    finally:
        await trainer.aclose()


class _StubCompletion:
    def __init__(self, text: str) -> None:
        self.text = text
        self.cumulative_logprob = -1.25


class _StubOutput:
    def __init__(self, text: str) -> None:
        self.outputs = [_StubCompletion(text)]


class _StubLLM:
    """Shaped like vllm.LLM.chat's return value: [RequestOutput(outputs=[CompletionOutput])]."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, dict[str, Any]]] = []

    def chat(self, messages: Any, params: Any, **kw: Any) -> list[_StubOutput]:
        self.calls.append((messages, params, kw))
        choices = params["choices"]
        return [_StubOutput(choices[len(self.calls) % len(choices)])]


def test_vllm_policy_request_and_parsing_with_a_stub_engine() -> None:
    llm = _StubLLM()
    task = TMAP["files-ab"]
    pol = VLLMPolicy("stub-model", TASKS, llm=llm, params_factory=lambda **kw: kw, seed=1)
    ctx = SampleContext(task.id, 2, 0, task.prompt)
    action = asyncio.run(pol.act(ctx, []))
    _messages, params, kw = llm.calls[0]
    assert params["choices"] == task.actions and isinstance(params["seed"], int)
    assert {t["function"]["name"] for t in kw["tools"]} == {"shell", "read_file", "write_file"}
    assert action == parse_action(task.actions[1 % len(task.actions)])
    assert pol.behaviour_logprobs(0) == {(task.id, 2, 0): -1.25}


def test_vllm_policy_without_vllm_says_why() -> None:
    ok, why = vllm_available()
    if ok:
        pytest.skip("vllm and a GPU are present: test_vllm_policy_on_gpu covers VLLMPolicy")
    assert "vllm" in why
    with pytest.raises(BackendUnavailable, match="VLLMPolicy is unavailable here"):
        VLLMPolicy("any/model", TASKS)


def test_vllm_policy_on_gpu() -> None:
    ok, why = vllm_available()
    if not ok:
        pytest.skip(f"VLLMPolicy skipped: {why}")
    import os

    model = os.environ.get("BUNSHIN_VLLM_MODEL")
    if not model:
        pytest.skip("VLLMPolicy skipped: set BUNSHIN_VLLM_MODEL to a local model directory to run it")
    pol = VLLMPolicy(model, TASKS, gpu_memory_utilization=0.3, max_model_len=4096)
    task = TMAP["files-ab"]
    action = asyncio.run(pol.act(SampleContext(task.id, 0, 0, task.prompt), []))
    assert isinstance(action, ToolCall) or action is not None
    assert any(a == FINAL or parse_action(a) for a in task.actions)
