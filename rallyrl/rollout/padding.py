"""Padding token-id lists into batches: prompts on the left, responses on the right (the one place)."""

from __future__ import annotations

import torch


def pad(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask; ``left`` for prompts (every response then starts at the same column),
    right for responses."""
    lens = [len(x) for x in seqs]
    width = max(lens, default=0)
    # One tensor from padded Python lists and a mask from the lengths: one torch call per batch, not two
    # per row (milliseconds per generation chunk; benchmarks/README.md, floors).
    rows = [[pad_id] * (width - n) + list(x) if left else list(x) + [pad_id] * (width - n) for x, n in zip(seqs, lens)]
    ids = torch.tensor(rows, dtype=torch.long).reshape(len(seqs), width)
    cols, n = torch.arange(width), torch.tensor(lens, dtype=torch.long).reshape(-1, 1)
    mask = cols >= width - n if left else cols < n  # (B, L)
    return ids, mask
