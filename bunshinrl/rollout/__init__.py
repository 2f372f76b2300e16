"""The rollout: one sample as a state machine stepped a call at a time through speculation, the
prefix cache and real execution (core), the one wiring of Base/Spec/Full (wiring), the asyncio
engine running GRPO groups on it, per-sample timelines and the reasoning clock."""
