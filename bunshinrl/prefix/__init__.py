"""The tool-prefix cache: the tree of tool calls per (task, initial workspace), the
ancestor-aware LRU over its resident states, and ToolPrefixCache (lookup, recording, eviction,
restore or replay)."""
