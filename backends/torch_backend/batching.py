"""A batch of sequences laid out for a model: padded rows, or packed into one row without
padding; split over data-parallel ranks and micro-batches by tokens, not by count.

    >>> balance([5, 1, 4, 2, 3], 2)                  # token-balanced: 5 + 2 + 1 and 4 + 3
    [[0, 1, 3], [2, 4]]
    >>> rows = Flat.build([np.array([7, 8])], [np.array([9, 10, 11])])
    >>> rows.ids.tolist(), rows.positions.tolist(), rows.gather.tolist()
    ([[7, 8, 9, 10, 11]], [[0, 1, 2, 3, 4]], [[1, 2, 3]])

Each sequence is a prompt followed by its response; a model predicts response token t from
the position before it (``gather``). :class:`Padded` right-pads every sequence to the
batch's longest and masks the padding. :class:`Flat` concatenates them into one row
whose position ids restart at 0 for each sequence and passes no attention mask, so
attention stays inside each sequence (transformers builds the block-causal mask from
the position ids): no padding is computed, and every real token sees exactly the tokens it
sees padded. Both lay per-token values out in their own token order (``layout``) and cut
per-token outputs back into one array per sequence (``split``).

:func:`balance` deals sequences to bins with the fewest tokens so far, longest first:
across the data-parallel ranks of a train op, and within a rank's minibatch across its
micro-batches (the plan's count: every rank runs as many, since each backward pass of a
sharded model is a collective).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from backends.torch_backend.tokenizer import PAD_ID


def balance(lengths, bins: int) -> list[list[int]]:
    """Indices of ``lengths`` dealt to ``bins`` bins of about equal total: each, longest
    first, to the bin with the smallest total so far (ties: the lower bin). Each bin lists
    its indices in ascending order; the same input gives the same bins on every rank."""
    bins = max(int(bins), 1)
    totals = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        b = min(range(bins), key=lambda k: (totals[k], k))
        out[b].append(i)
        totals[b] += int(lengths[i])
    return [sorted(b) for b in out]


@attrs.frozen
class Padded:
    """Prompt + response token ids, right-padded, and where each response token is predicted."""

    ids: torch.Tensor           # [B, L]
    mask: torch.Tensor          # [B, L]
    gather: torch.Tensor        # [B, T] position whose output predicts response token t
    targets: torch.Tensor       # [B, T]
    resp_mask: torch.Tensor     # [B, T] float
    positions: torch.Tensor | None = None     # None: 0..L-1 in every row

    @classmethod
    def build(cls, prompt_ids, response_ids, device="cpu") -> Padded:
        n = len(prompt_ids)
        total = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True))
        t_max = max(len(r) for r in response_ids)
        ids = torch.full((n, total), PAD_ID, dtype=torch.long)
        mask = torch.zeros((n, total), dtype=torch.long)
        gather = torch.zeros((n, t_max), dtype=torch.long)
        targets = torch.full((n, t_max), PAD_ID, dtype=torch.long)
        resp_mask = torch.zeros((n, t_max), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            lp, lr = len(p), len(r)
            ids[i, :lp] = torch.as_tensor(p)
            ids[i, lp:lp + lr] = torch.as_tensor(r)
            mask[i, :lp + lr] = 1
            gather[i, :lr] = torch.arange(lp - 1, lp - 1 + lr)
            targets[i, :lr] = torch.as_tensor(r)
            resp_mask[i, :lr] = 1.0
        return cls(ids.to(device), mask.to(device), gather.to(device), targets.to(device),
                   resp_mask.to(device))

    def select(self, idx: torch.Tensor) -> Padded:
        return Padded(self.ids[idx], self.mask[idx], self.gather[idx], self.targets[idx],
                      self.resp_mask[idx])

    def layout(self, rows, device="cpu") -> torch.Tensor:
        """Per-token values (or one value per sequence, broadcast) as a [B, T] tensor."""
        n, t = self.targets.shape
        out = torch.zeros((n, t), dtype=torch.float32)
        for i, r in enumerate(rows):
            r = np.asarray(r, dtype=np.float32)
            if r.ndim == 0:
                out[i, :] = float(r)
            else:
                out[i, : len(r)] = torch.from_numpy(r)
        return out.to(device)

    def split(self, x: torch.Tensor, lengths) -> tuple[np.ndarray, ...]:
        x = x.detach().float().cpu().numpy()
        return tuple(x[i, :n].astype(np.float32) for i, n in enumerate(lengths))

    # one sequence a row, as losses aggregate them (``losses.aggregate``): already so
    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sequence_mask(self) -> torch.Tensor:
        return self.resp_mask

    def sequence_layout(self, rows, device="cpu") -> torch.Tensor:
        return self.layout(rows, device)


@attrs.frozen
class Flat:
    """Several sequences in one row, no padding: position ids restart at each sequence."""

    ids: torch.Tensor           # [1, S] every prompt and response token
    positions: torch.Tensor     # [1, S] 0.. within each sequence
    gather: torch.Tensor        # [1, T] position whose output predicts response token t
    targets: torch.Tensor       # [1, T] every response token, sequence after sequence
    resp_mask: torch.Tensor     # [1, T] ones
    lengths: tuple[int, ...] = ()   # response tokens of each sequence
    mask: None = None

    @classmethod
    def build(cls, prompt_ids, response_ids, device="cpu") -> Flat:
        ids, positions, gather, targets = [], [], [], []
        start = 0
        for p, r in zip(prompt_ids, response_ids, strict=True):
            lp, lr = len(p), len(r)
            ids += [np.asarray(p, np.int64), np.asarray(r, np.int64)]
            positions.append(np.arange(lp + lr))
            gather.append(start + np.arange(lp - 1, lp - 1 + lr))
            targets.append(np.asarray(r, np.int64))
            start += lp + lr

        def row(parts):
            return torch.from_numpy(np.concatenate(parts).astype(np.int64))[None].to(device)
        t = row(targets)
        return cls(row(ids), row(positions), row(gather), t,
                   torch.ones(t.shape, dtype=torch.float32, device=device),
                   tuple(len(r) for r in response_ids))

    def layout(self, rows, device="cpu") -> torch.Tensor:
        """Per-token values (or one value per sequence, broadcast) as a [1, T] tensor."""
        parts = []
        for r, n in zip(rows, self.lengths, strict=True):
            r = np.asarray(r, dtype=np.float32)
            parts.append(np.full(n, float(r), np.float32) if r.ndim == 0 else r[:n])
        return torch.from_numpy(np.concatenate(parts))[None].to(device)

    # one sequence a row, as losses aggregate them (``losses.aggregate``): each sequence's
    # response tokens gathered from the row into a row of their own, right-padded with zeros
    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, t = len(self.lengths), max(self.lengths, default=0)
        index = torch.zeros((n, t), dtype=torch.long)
        mask = torch.zeros((n, t), dtype=torch.float32)
        start = 0
        for i, k in enumerate(self.lengths):
            index[i, :k] = torch.arange(start, start + k)
            mask[i, :k] = 1.0
            start += k
        return index.to(self.targets.device), mask.to(self.targets.device)

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """A [1, T] per-token tensor as [B, T_max] (differentiable)."""
        index, mask = self._rows()
        return x[0][index] * mask.to(x.dtype)

    def sequence_mask(self) -> torch.Tensor:
        return self._rows()[1]

    def sequence_layout(self, rows, device="cpu") -> torch.Tensor:
        """Per-token values (or one value per sequence, broadcast) as a [B, T_max] tensor."""
        index, mask = self._rows()
        out = torch.zeros(mask.shape, dtype=torch.float32)
        for i, (r, k) in enumerate(zip(rows, self.lengths, strict=True)):
            r = np.asarray(r, dtype=np.float32)
            out[i, :k] = float(r) if r.ndim == 0 else torch.from_numpy(r[:k])
        return out.to(device)

    def split(self, x: torch.Tensor, lengths) -> tuple[np.ndarray, ...]:
        x = x.detach().float().cpu().numpy()[0]
        ends = np.cumsum(lengths)
        return tuple(x[e - n:e].astype(np.float32) for e, n in zip(ends, lengths, strict=True))


def build(prompt_ids, response_ids, packed: bool, device="cpu") -> Padded | Flat:
    return (Flat if packed else Padded).build(prompt_ids, response_ids, device)


def micro_batches(lengths, count: int) -> list[list[int]]:
    """``count`` token-balanced micro-batches of the sequences with these lengths (some
    empty when there are fewer sequences than micro-batches)."""
    return balance(lengths, count)


__all__ = ["Flat", "Padded", "balance", "build", "micro_batches"]
