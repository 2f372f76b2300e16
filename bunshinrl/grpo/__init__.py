"""The name bunshinrl.training had before bunshinrl was in folders, kept for a release:
`from bunshinrl.grpo import GRPOTrainer, suite, testmodel` still works. New code imports
bunshinrl.training (the trainer, the suite, episodes) and bunshinrl.policies (the LLM policies)."""

from __future__ import annotations

from typing import Any

from .. import training
from ..training import *  # noqa: F403 (the whole face, as before)
from ..training import __all__ as __all__


def __getattr__(name: str) -> Any:
    return getattr(training, name)  # the lazy names: HFPolicy, GRPOTrainer, testmodel, ...
