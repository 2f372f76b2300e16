"""Cgroups: each workspace's resource limits and the freezer that every capture rests on.

One cgroup per workspace (freezer, memory, pids on cgroup v1; the same on a unified v2
hierarchy) with its memory and pids limits, so the OOM killer acts inside the workspace.
A fork freezes the source through it (paper §4.2: the freeze covers metadata capture,
holder creation and the file-system snapshot) and restores each clone into its own.
"""

from .cgroup import Cgroup, detect, leftover_cgroups

__all__ = ["Cgroup", "detect", "leftover_cgroups"]
