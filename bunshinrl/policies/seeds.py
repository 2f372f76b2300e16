"""Per-decision sampling seeds, shared by every LLM policy and the harness's random agent."""

from __future__ import annotations

import hashlib


def sample_seed(seed: int, epoch: int, task_id: str, sample: int, step: int) -> int:
    """The sampling seed of one decision. Keyed by what the decision is, never by when it is
    made, so Base, Spec and Full sample identically however the engine interleaves rollouts.
    31 bits: what every backend's seed parameter accepts (OpenAI's API, vLLM, torch), so all
    backends draw with the very same seed."""
    h = hashlib.sha256(f"{seed}/{epoch}/{task_id}/{sample}/{step}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFF_FFFF
