"""Padding collator: pads token sequences to a multiple of ``pad_to_multiple_of`` and builds attention masks.

Samples may be dicts holding ``input_ids`` (HF ``datasets`` rows, list or tensor values), tensors, or lists
of ids. Output: ``input_ids`` [B, L] (long), ``attention_mask`` [B, L] (1 = real token), and ``labels``
[B, L] (the sample's ``labels`` if it has them, else its ids; padding is ``label_pad_id`` so the loss
ignores it). L is the longest sample rounded up to the multiple, so a run sees few distinct shapes.
"""

from __future__ import annotations

from typing import Any

import torch


def _as_ids(value: Any, what: str) -> torch.Tensor:
    ids = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if ids.dim() != 1:
        raise ValueError(f"PadCollator: {what} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    return ids.long()


class PadCollator:
    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int = 128, *, column: str = "input_ids",
                 label_pad_id: int = -100, padding_side: str = "right"):
        if pad_to_multiple_of < 1:
            raise ValueError(f"PadCollator: pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if padding_side not in ("right", "left"):
            raise ValueError(f"PadCollator: padding_side must be 'right' or 'left', got {padding_side!r}")
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of
        self.column, self.label_pad_id, self.padding_side = column, label_pad_id, padding_side

    def __call__(self, samples: list[Any]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("PadCollator: empty batch")
        ids, labels = [], []
        for sample in samples:
            if isinstance(sample, dict):
                if self.column not in sample:
                    raise ValueError(f"PadCollator: sample has no {self.column!r} (keys: {sorted(sample)})")
                seq = _as_ids(sample[self.column], self.column)
                lab = _as_ids(sample["labels"], "labels") if "labels" in sample else seq
            else:
                seq = lab = _as_ids(sample, "a sample")
            if len(lab) != len(seq):
                raise ValueError(f"PadCollator: labels ({len(lab)}) and {self.column} ({len(seq)}) differ in length")
            ids.append(seq)
            labels.append(lab)
        longest = max(len(s) for s in ids)
        width = max(1, -(-longest // self.pad_to_multiple_of)) * self.pad_to_multiple_of
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        label_ids = torch.full((len(ids), width), self.label_pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, (seq, lab) in enumerate(zip(ids, labels)):
            span = slice(0, len(seq)) if self.padding_side == "right" else slice(width - len(seq), width)
            input_ids[row, span] = seq
            label_ids[row, span] = lab
            mask[row, span] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": label_ids}
