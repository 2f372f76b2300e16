"""Speculative tool execution: the next-call classifier (ToolSelector), the tail-aware policy
that says when to speculate, and the Speculator's chains (a branch adopted or rolled back)."""
