"""bunshinrl: agentic-RL rollouts on live-forked workspaces (BunshinRL paper, section 3).

Memory sharing (groups fork one initialized workspace), tool-prefix caching (ToolPrefixCache),
speculative tool execution (Speculator with a ToolSelector), driven by RolloutEngine. Each part
also works on its own inside another trainer; see bunshinrl/README.md.
"""

from .calls.contract import ContractError, check_policy, check_policy_async
from .calls.determinism import FamilyNotDeterministic, FamilyReport, ToolDifference, check_family, check_family_async
from .calls.guard import DeterminismGuard
from .calls.policy import Action, FinalAnswer, Policy, SampleContext, Step
from .calls.replies import parse_message, parse_reply, render_call
from .calls.signature import ToolCall, prefix_signature, template_digest
from .calls.task import INVALID_TOOL, REWARD_TOOL, Task
from .calls.tools import Tool, ToolSet, shell_tool, string_params
from .prefix.cache import Plan, ReplayDiverged, ToolPrefixCache
from .rollout.audit import AuditReport, TrajectoryAuditor
from .rollout.core import Rewound, Rollout, RolloutCore
from .rollout.engine import RolloutEngine
from .rollout.timeline import EpochResult, SampleTimeline
from .speculation.selector import (
    NotFittedError,
    SelectorContext,
    SelectorReport,
    ToolSelector,
    Trajectory,
    is_fitted,
    train_selector,
)
from .speculation.speculator import SpecHit, SpeculationError, SpeculativeBranch, Speculator
from .speculation.tail import TailPolicy
from .states.backend import SharedSnapshot, SnapshotBackend, StateBackend
from .states.contract import check_backend, check_backend_async
from .states.store import BlobStore

__all__ = [
    "INVALID_TOOL", "REWARD_TOOL", "Action", "AuditReport", "BlobStore", "ContractError", "DeterminismGuard",
    "EpochResult", "FamilyNotDeterministic", "FamilyReport", "FinalAnswer", "NotFittedError", "Plan", "Policy",
    "ReplayDiverged", "Rewound", "Rollout", "RolloutCore", "RolloutEngine", "SampleContext", "SampleTimeline",
    "SelectorContext", "SelectorReport", "SharedSnapshot", "SnapshotBackend", "SpecHit", "SpeculationError",
    "SpeculativeBranch", "Speculator", "StateBackend", "Step", "TailPolicy", "Task", "Tool", "ToolCall",
    "ToolDifference", "ToolPrefixCache", "ToolSelector", "ToolSet", "Trajectory", "TrajectoryAuditor",
    "check_backend", "check_backend_async", "check_family", "check_family_async", "check_policy",
    "check_policy_async", "is_fitted", "parse_message", "parse_reply", "prefix_signature", "render_call",
    "shell_tool", "string_params", "template_digest", "train_selector",
]
