"""bunshinrl: agentic-RL rollouts on live-forked workspaces (BunshinRL paper, section 3).

Memory sharing (groups fork one initialized workspace), tool-prefix caching (ToolPrefixCache),
speculative tool execution (Speculator with a ToolSelector), driven by RolloutEngine. Each part
also works on its own inside another trainer; see bunshinrl/README.md.
"""

from .backend import SharedSnapshot, SnapshotBackend, StateBackend
from .cache import Plan, ReplayDiverged, ToolPrefixCache
from .core import Rollout, RolloutCore
from .engine import RolloutEngine
from .guard import DeterminismGuard
from .policy import Action, FinalAnswer, Policy, SampleContext, Step
from .replies import parse_message, parse_reply, render_call
from .selector import SelectorContext, SelectorReport, ToolSelector, Trajectory, train_selector
from .signature import ToolCall, prefix_signature, template_digest
from .speculator import SpecHit, SpeculationError, SpeculativeBranch, Speculator
from .store import BlobStore
from .tail import TailPolicy
from .task import INVALID_TOOL, REWARD_TOOL, Task
from .timeline import EpochResult, SampleTimeline
from .tools import Tool, ToolSet, shell_tool, string_params

__all__ = [
    "INVALID_TOOL", "REWARD_TOOL", "Action", "BlobStore", "DeterminismGuard", "EpochResult", "FinalAnswer", "Plan",
    "Policy", "ReplayDiverged", "Rollout", "RolloutCore", "RolloutEngine", "SampleContext", "SampleTimeline",
    "SelectorContext", "SelectorReport", "SharedSnapshot", "SnapshotBackend", "SpecHit", "SpeculationError",
    "SpeculativeBranch", "Speculator", "StateBackend", "Step", "TailPolicy", "Task", "Tool", "ToolCall",
    "ToolPrefixCache", "ToolSelector", "ToolSet", "Trajectory", "parse_message", "parse_reply", "prefix_signature",
    "render_call", "shell_tool", "string_params", "template_digest", "train_selector",
]
