"""Workspace states: retained snapshots (SharedSnapshot) and their disk form (StateBackend), the
content-addressed block store and delta chains under it, and memory accounting of the
workspaces a rollout holds."""
