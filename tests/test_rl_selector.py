"""ToolSelector as a scikit-learn estimator, and training it on recorded trajectories."""

from __future__ import annotations

import pickle
import random

import numpy as np
from sklearn.base import clone

from bunshinrl import ToolCall, ToolSelector, Trajectory, train_selector
from bunshinrl.speculation.selector import FINAL, SelectorContext, examples

LS, CAT, TEST, EDIT = (ToolCall("ls"), ToolCall("cat", {"path": "a"}), ToolCall("run_tests"),
                       ToolCall("edit", {"path": "a", "find": "x", "replace": "y"}))


def _trajectories() -> list[Trajectory]:
    out = []
    for epoch in range(3):
        for sample in range(4):
            calls = (LS, CAT, TEST, EDIT, TEST) if sample % 2 == 0 else (LS, CAT, EDIT, TEST)
            out.append(Trajectory(epoch, "t0", sample, calls))
            out.append(Trajectory(epoch, "t1", sample, (CAT, LS, TEST)))
    return out


def test_fit_predict_proba_predict() -> None:
    X, y = examples(_trajectories())
    sel = ToolSelector(n_features=2**10).fit(X, y)
    assert set(sel.classes_) == {LS.key, CAT.key, TEST.key, EDIT.key, FINAL}
    proba = sel.predict_proba(X[:5])
    assert proba.shape == (5, len(sel.classes_))
    assert np.allclose(proba.sum(axis=1), 1.0)
    # Deterministic prefixes are learnt exactly.
    assert sel.predict([SelectorContext("t0", ())])[0] == LS.key
    assert sel.predict([SelectorContext("t1", ())])[0] == CAT.key
    assert sel.predict([SelectorContext("t1", (CAT, LS, TEST))])[0] == FINAL
    assert sel.score(X, y) > 0.8
    assert sel.predict_chain(SelectorContext("t0", (LS,)), depth=3)[:1] == [CAT]
    assert sel.predict_chain(SelectorContext("t1", (CAT, LS, TEST)), depth=3) == []  # the final answer


def test_params_clone_and_pickle() -> None:
    sel = ToolSelector(n_features=2**10, C=3.0)
    assert sel.get_params() == {"n_features": 2**10, "C": 3.0, "max_iter": 200}
    sel.set_params(C=5.0, max_iter=50)
    assert sel.C == 5.0 and sel.max_iter == 50
    assert clone(sel).get_params() == sel.get_params()
    X, y = examples(_trajectories())
    sel.fit(X, y)
    back = pickle.loads(pickle.dumps(sel))
    assert np.array_equal(back.predict_proba(X), sel.predict_proba(X))
    assert list(back.classes_) == list(sel.classes_)


def test_single_class_history() -> None:
    sel = ToolSelector().fit([SelectorContext("t", ())], [LS.key])
    assert sel.predict([SelectorContext("t", (LS,))])[0] == LS.key
    assert sel.predict_proba([SelectorContext("t", ())]).shape == (1, 1)


def _drifting(tasks: int = 3, group: int = 4, epochs: int = 3, p_main: float = 0.85) -> list[Trajectory]:
    """A policy with a preferred path per task, leaving it at random (more often in later epochs)."""
    pool = [LS, CAT, TEST, EDIT, ToolCall("grep", {"pattern": "x"}), ToolCall("build")]
    out = []
    for e in range(epochs):
        for t in range(tasks):
            main = [pool[(t + i * (t + 1)) % len(pool)] for i in range(8)]
            for s in range(group):
                rng = random.Random(f"{e}|{t}|{s}")
                calls = tuple(c if rng.random() < p_main - 0.03 * e else rng.choice(pool) for c in main)
                out.append(Trajectory(e, f"task{t}", s, calls))
    return out


def test_train_selector_reports_held_out_accuracy() -> None:
    trajs = _drifting()
    _sel, report = train_selector(trajs, k=3)
    assert report.held_out_epochs == (2,)
    assert report.train_examples > report.test_examples > 0
    assert 0.0 <= report.top1 <= report.topk <= 1.0
    # A drifting but repetitive policy is mostly predictable from earlier epochs.
    assert report.top1 > 0.5 and report.topk > report.top1
