"""The verifiable task suite on real workspaces: known solutions score 1, the initial state 0,
partial work partial credit, and the reward is read from the workspace, not the transcript."""

from __future__ import annotations

from bunshinfork import Workspace
from bunshinrl import FinalAnswer, Task, ToolCall
from bunshinrl.policies.actions import FINAL, call, from_text
from bunshinrl.training.tasks import REWARD_TOOL, parse_reward, suite


def _initialized(task: Task) -> Workspace:
    return task.create()


def _run(task: Task, ws: Workspace, actions: list[str]) -> list[str]:
    """Execute action texts the way the engine would (tools are synchronous here)."""
    out = []
    for a in actions:
        if a == FINAL:
            break
        c = from_text(a)
        assert isinstance(c, ToolCall)
        out.append(task.call(ws, c.name, **c.args))
    return out


def _reward(task: Task, ws: Workspace) -> float:
    return parse_reward(task.call(ws, REWARD_TOOL))


def test_solutions_score_one_and_initial_states_zero() -> None:
    for task in suite():
        ws = _initialized(task)
        try:
            assert _reward(task, ws) == 0.0, task.id
            _run(task, ws, list(task.solution))
            assert _reward(task, ws) == 1.0, (task.id, task.verify(ws))
        finally:
            ws.destroy()


def test_partial_credit_and_what_does_not_count() -> None:
    tasks = {t.id: t for t in suite()}
    svc = tasks["service-pong"]
    ws = _initialized(svc)
    try:
        # Started before it was configured: it answers, with the wrong body.
        _run(svc, ws, [call("shell", cmd="sh /root/svc/start.sh")])
        assert _reward(svc, ws) == 0.2
        # Configuring and starting again restarts it with the new body.
        obs = _run(svc, ws, list(svc.solution))
        assert obs[-1].strip() == "service listening on 8081"
        assert _reward(svc, ws) == 1.0
        assert _run(svc, ws, [call("http_get", path="/")]) == ["pong\n[status 200]"]
        _run(svc, ws, [call("shell", cmd="sh /root/svc/stop.sh")])
        assert _reward(svc, ws) == 0.0
    finally:
        ws.destroy()

    fix = tasks["fix-both"]
    ws = _initialized(fix)
    try:
        _run(fix, ws, [fix.solution[0]])  # fixes add() only
        assert _reward(fix, ws) == 0.5
        # Deleting the workspace's test changes nothing: the verifier brings its own copy.
        _run(fix, ws, [call("shell", cmd="rm -f /root/proj/test_calc.py")])
        assert _reward(fix, ws) == 0.5
        _run(fix, ws, [fix.solution[1]])
        assert _reward(fix, ws) == 1.0
    finally:
        ws.destroy()

    files = tasks["files-ab"]
    ws = _initialized(files)
    try:
        _run(files, ws, [files.solution[0]])
        assert _reward(files, ws) == 0.5
        _run(files, ws, [call("write_file", path="/root/out/a.txt", content="beta\n")])
        assert _reward(files, ws) == 0.0
    finally:
        ws.destroy()


def test_observations_are_reproducible_across_forks() -> None:
    """Every candidate action observes only content (no pids, times, ids), so two forks of one
    state observe the same: what makes cached and speculative results valid."""
    for task in [t for t in suite() if t.id in ("service-pong", "fix-both")]:
        ws = _initialized(task)
        try:
            snap = ws.snapshot()
            try:
                clones = snap.fork(2, "ksm")
            finally:
                snap.release()
            try:
                assert all(isinstance(c, Workspace) for c in clones), clones
                script = [a for a in task.actions if a != FINAL] + list(task.solution)
                a, b = (_run(task, c, script) for c in clones)  # type: ignore[arg-type]
                assert a == b
            finally:
                for c in clones:
                    if isinstance(c, Workspace):
                        c.destroy()
        finally:
            ws.destroy()


def test_candidate_actions_are_valid_calls_and_the_verifier_is_hidden() -> None:
    tasks = suite()
    assert len({t.id for t in tasks}) == len(tasks) == 6
    assert {t.family for t in tasks} == {"files", "service", "fix"}
    for t in tasks:
        assert REWARD_TOOL not in t.agent_tools and REWARD_TOOL in t.engine_tools
        assert t.solution[-1] == FINAL and set(t.solution) <= set(t.actions)
        assert len(set(t.actions)) == len(t.actions)
        for a in t.actions:
            if a == FINAL:
                continue
            c = from_text(a)
            assert isinstance(c, ToolCall) and c.key == a
            assert t.agent_tools[c.name].check(c.args) is None


def test_action_texts_are_call_keys_or_final() -> None:
    key = call("write_file", path="/root/x", content="hi\n")
    assert from_text(key) == ToolCall("write_file", {"path": "/root/x", "content": "hi\n"})
    assert from_text(FINAL) == FinalAnswer("")
