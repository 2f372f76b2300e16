"""The vocabulary of calls: a ToolCall and its signature, tools, the task contract, parsing a
model's replies into calls, the policy protocol, and the guard that says which calls may be reused.
Every other folder of bunshinrl speaks it; it imports none of them."""
