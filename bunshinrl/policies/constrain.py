"""Constrained decoding to a list of choices, token by token, as vLLM's structured outputs do it.

vLLM's `structured_outputs={"choice": [...]}` (its grammar backend) allows, at every step, each
token whose bytes extend the text so far towards one of the choices, whatever tokenization
that makes (`<tool_call>` as one added token or as `<`, `tool`, ...), and only end-of-sequence
once a choice is complete. Its returned log-probs are those of that masked distribution.
ChoiceConstraint computes the very same allowed sets from token bytes, so that in-process
generation (`prefix_allowed_tokens_fn` of transformers' generate) samples under the same rule,
and the learner recomputes the rollout's log-probs under the mask that produced them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's printable stand-ins for raw bytes (the ByteLevel pre-tokenizer's alphabet).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """The bytes each token id stands for; None for special tokens (never part of a choice).
    Byte-level BPE vocabularies (GPT-2, Qwen, Llama 3) and SentencePiece ones (`▁`, `<0x0A>`)."""
    dec = _byte_decoder()
    special = set(tokenizer.all_special_ids)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    out: list[bytes | None] = []
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or tok is None:
            out.append(None)
        elif i in added:
            out.append(added[i].encode())
        elif tok.startswith("<0x") and tok.endswith(">") and len(tok) == 6:
            out.append(bytes([int(tok[3:5], 16)]))
        elif all(ch in dec for ch in tok):
            out.append(bytes(dec[ch] for ch in tok))
        else:
            out.append(tok.replace("\u2581", " ").encode())
    return out


class Vocabulary:
    """Token bytes indexed for prefix lookups; one per tokenizer."""

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int], size: int | None = None) -> None:
        self.bytes = token_bytes(tokenizer)
        # The model's vocabulary may be padded beyond the tokenizer's (to a multiple of 64).
        self.size = max(size or 0, len(self.bytes))
        self.eos = tuple(sorted(set(eos_ids)))
        self.by_bytes: dict[bytes, list[int]] = defaultdict(list)
        for i, b in enumerate(self.bytes):
            if b:
                self.by_bytes[b].append(i)
        self.longest = max((len(b) for b in self.by_bytes), default=1)


class ChoiceConstraint:
    """The generation must be exactly one of `choices` (then end-of-sequence)."""

    def __init__(self, vocab: Vocabulary, choices: Sequence[str]) -> None:
        if not choices:
            raise ValueError("a choice constraint needs at least one choice")
        self.vocab = vocab
        self.choices = tuple(dict.fromkeys(c.encode() for c in choices))
        self._cache: dict[bytes, tuple[int, ...]] = {}

    def text(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.vocab.bytes[i] or b"" for i in ids)

    def allowed_after(self, done: bytes) -> tuple[int, ...]:
        """Token ids allowed once `done` has been generated (empty: a dead end)."""
        hit = self._cache.get(done)
        if hit is not None:
            return hit
        allowed: set[int] = set()
        for c in self.choices:
            if not c.startswith(done):
                continue
            rest = c[len(done):]
            if not rest:
                allowed.update(self.vocab.eos)
            for n in range(1, min(len(rest), self.vocab.longest) + 1):
                allowed.update(self.vocab.by_bytes.get(rest[:n], ()))
        out = tuple(sorted(allowed))
        self._cache[done] = out
        return out

    def allowed(self, generated: Sequence[int]) -> tuple[int, ...]:
        return self.allowed_after(self.text([i for i in generated if i not in self.vocab.eos]))

    def allowed_each(self, generated: Sequence[int]) -> list[tuple[int, ...]]:
        """For each position of a generated sequence, the ids that were allowed there (what the
        sampler saw before that token)."""
        out, done = [], b""
        for tok in generated:
            out.append(self.allowed_after(done))
            done += self.vocab.bytes[tok] or b""
        return out


__all__ = ["ChoiceConstraint", "Vocabulary", "token_bytes"]
