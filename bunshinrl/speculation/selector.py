"""ToolSelector: a small classifier predicting the next tool call from the trajectory so far.

The candidates are the calls recorded in history (plus the final answer), so a prediction can
always be executed exactly as the policy would call it. Features are hashed strings describing
the task, the step, the last calls and the whole prefix: the exact prefix memorises recurring
trajectories, the shorter contexts generalise to prefixes that drifted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.exceptions import NotFittedError
from sklearn.feature_extraction import FeatureHasher
from sklearn.linear_model import LogisticRegression
from sklearn.utils.validation import check_is_fitted

from ..calls.signature import ToolCall

FINAL = "<final>"


@dataclass(frozen=True)
class SelectorContext:
    """What the selector sees: the task and the calls made so far (step = len(calls))."""

    task_id: str
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Trajectory:
    """A recorded rollout: its calls in order, and whether it ended with a final answer."""

    epoch: int
    task_id: str
    sample: int
    calls: tuple[ToolCall, ...]
    finished: bool = True


def _features(ctx: SelectorContext) -> list[str]:
    calls = ctx.calls
    last = calls[-1].key if calls else "<start>"
    last2 = calls[-2].key if len(calls) > 1 else "<start>"
    prefix = hashlib.sha1("\x1f".join(c.key for c in calls).encode()).hexdigest()[:16]
    feats = [
        "bias", f"task={ctx.task_id}", f"step={min(len(calls), 30)}", f"last={last}",
        f"last2={last2}|{last}", f"lasttool={calls[-1].name if calls else '<start>'}",
        f"prefix={ctx.task_id}|{prefix}", f"task_last={ctx.task_id}|{last}",
        f"task_step={ctx.task_id}|{len(calls)}",
    ]
    feats += sorted({f"used={c.key}" for c in calls})
    return feats


class ToolSelector(ClassifierMixin, BaseEstimator):
    """X: a sequence of SelectorContext; y: the label of the next call (ToolCall.key or FINAL)."""

    def __init__(self, n_features: int = 2**12, C: float = 1.0, max_iter: int = 200) -> None:
        self.n_features = n_features
        self.C = C
        self.max_iter = max_iter

    def _matrix(self, X: Sequence[SelectorContext]):  # type: ignore[no-untyped-def]
        hasher = FeatureHasher(n_features=self.n_features, input_type="string", alternate_sign=False)
        return hasher.transform(_features(x) for x in X)

    def fit(self, X: Sequence[SelectorContext], y: Sequence[str]) -> ToolSelector:
        y_arr = np.asarray(list(y), dtype=object)
        if len(y_arr) != len(X):
            raise ValueError(f"X has {len(X)} contexts but y has {len(y_arr)} labels")
        self.classes_ = np.array(sorted(set(y_arr.tolist())), dtype=object)
        if len(self.classes_) == 1:
            # LogisticRegression refuses one class; with one candidate there is nothing to learn.
            self.model_ = None
        else:
            self.model_ = LogisticRegression(C=self.C, max_iter=self.max_iter)
            self.model_.fit(self._matrix(X), y_arr)
            self.classes_ = self.model_.classes_
        return self

    def predict_proba(self, X: Sequence[SelectorContext]) -> np.ndarray:
        """Raises NotFittedError (scikit-learn's) before fit()."""
        check_is_fitted(self, ("classes_", "model_"))
        if self.model_ is None:
            return np.ones((len(X), 1))
        return self.model_.predict_proba(self._matrix(X))

    def predict(self, X: Sequence[SelectorContext]) -> np.ndarray:
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]

    def top_k(self, ctx: SelectorContext, k: int = 3) -> list[tuple[str, float]]:
        """The k most likely next labels with their probabilities."""
        p = self.predict_proba([ctx])[0]
        order = np.argsort(-p, kind="stable")[:k]
        return [(str(self.classes_[i]), float(p[i])) for i in order]

    def predict_chain(self, ctx: SelectorContext, depth: int, min_probability: float = 0.0) -> list[ToolCall]:
        """Greedily predict up to `depth` next calls, stopping at the final answer or at a guess
        less likely than min_probability (speculating on it would most likely be wasted)."""
        return [c for c, _ in self.predict_chain_proba(ctx, depth, min_probability)]

    def predict_chain_proba(self, ctx: SelectorContext, depth: int,
                            min_probability: float = 0.0) -> list[tuple[ToolCall, float]]:
        """predict_chain's calls, each with its probability given the calls before it."""
        out: list[tuple[ToolCall, float]] = []
        calls = ctx.calls
        for _ in range(depth):
            label, p = self.top_k(SelectorContext(ctx.task_id, calls), 1)[0]
            if label == FINAL or p < min_probability:
                break
            call = ToolCall.from_key(label)
            out.append((call, p))
            calls = (*calls, call)
        return out


def is_fitted(selector: ToolSelector | None) -> bool:
    """Whether `selector` may predict (scikit-learn's check_is_fitted passes); False for None."""
    if selector is None:
        return False
    try:
        check_is_fitted(selector, ("classes_", "model_"))
    except NotFittedError:
        return False
    return True


def examples(trajectories: Iterable[Trajectory]) -> tuple[list[SelectorContext], list[str]]:
    """One (context, next-call label) pair per step, and the final answer after finished ones."""
    X: list[SelectorContext] = []
    y: list[str] = []
    for t in trajectories:
        for i, c in enumerate(t.calls):
            X.append(SelectorContext(t.task_id, t.calls[:i]))
            y.append(c.key)
        if t.finished:
            X.append(SelectorContext(t.task_id, t.calls))
            y.append(FINAL)
    return X, y


@dataclass(frozen=True)
class SelectorReport:
    top1: float
    topk: float
    k: int
    train_examples: int
    test_examples: int
    classes: int
    held_out_epochs: tuple[int, ...]


def evaluate(selector: ToolSelector, X: Sequence[SelectorContext], y: Sequence[str], k: int) -> tuple[float, float]:
    """Top-1 and top-k accuracy; a label the selector never saw counts as wrong."""
    if not X:
        return 0.0, 0.0
    proba = selector.predict_proba(X)
    order = np.argsort(-proba, axis=1, kind="stable")
    classes = selector.classes_
    top1 = topk = 0
    for i, label in enumerate(y):
        ranked = classes[order[i, :k]]
        top1 += ranked[0] == label
        topk += label in ranked
    return top1 / len(y), topk / len(y)


def train_selector(trajectories: Sequence[Trajectory], held_out_epochs: Iterable[int] | None = None, k: int = 3,
                   **params: float) -> tuple[ToolSelector, SelectorReport]:
    """Fit on every epoch but the held-out ones (default: the last) and report top-1/top-k there."""
    epochs = sorted({t.epoch for t in trajectories})
    held = tuple(sorted(held_out_epochs)) if held_out_epochs is not None else tuple(epochs[-1:])
    train = [t for t in trajectories if t.epoch not in held]
    test = [t for t in trajectories if t.epoch in held]
    if not train:
        raise ValueError("no trajectories left to train on outside the held-out epochs")
    Xtr, ytr = examples(train)
    Xte, yte = examples(test)
    sel = ToolSelector(**params).fit(Xtr, ytr)  # type: ignore[arg-type]
    top1, topk = evaluate(sel, Xte, yte, k)
    return sel, SelectorReport(top1, topk, k, len(Xtr), len(Xte), len(sel.classes_), held)


__all__ = ["FINAL", "NotFittedError", "SelectorContext", "SelectorReport", "ToolSelector", "Trajectory", "evaluate",
           "examples", "is_fitted", "train_selector"]
