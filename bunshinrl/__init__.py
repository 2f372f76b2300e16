"""bunshinrl: agentic-RL rollouts on live-forked workspaces (BunshinRL paper, section 3).

Memory sharing (groups fork one initialized workspace), tool-prefix caching (ToolPrefixCache),
speculative tool execution (Speculator with a ToolSelector), driven by RolloutEngine. Each part
also works on its own inside another trainer; see bunshinrl/README.md.
"""

from . import _blas  # noqa: F401  (must run before numpy is imported)
from .backend import SharedSnapshot, SnapshotBackend, StateBackend
from .cache import Plan, ReplayDiverged, ToolPrefixCache
from .engine import RolloutEngine
from .guard import DeterminismGuard
from .policy import Action, Environment, FinalAnswer, Policy, SampleContext, Step, Task
from .selector import SelectorContext, SelectorReport, ToolSelector, Trajectory, train_selector
from .signature import ToolCall, prefix_signature, template_digest
from .speculator import SpecHit, SpeculationError, SpeculativeBranch, Speculator
from .store import BlobStore
from .tail import TailPolicy
from .timeline import EpochResult, SampleTimeline
from .tools import Tool, ToolSet, shell_tool

__all__ = [
    "Action", "BlobStore", "DeterminismGuard", "Environment", "EpochResult", "FinalAnswer", "Plan", "Policy",
    "ReplayDiverged", "RolloutEngine", "SampleContext", "SampleTimeline", "SelectorContext", "SelectorReport",
    "SharedSnapshot", "SnapshotBackend", "SpecHit", "SpeculationError", "SpeculativeBranch", "Speculator",
    "StateBackend", "Step", "TailPolicy", "Task", "Tool", "ToolCall", "ToolPrefixCache", "ToolSelector", "ToolSet",
    "Trajectory", "prefix_signature", "shell_tool", "template_digest", "train_selector",
]
