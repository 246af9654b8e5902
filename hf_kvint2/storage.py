"""Growable token-axis buffers for the INT2 body (amortised O(1) appends instead of a ``torch.cat`` per step)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TokenBuffer:
    """A tensor that grows along ``dim``; ``rows`` of its capacity are in use.

    One row may stand for several tokens (per-channel scales cover ``group_size`` tokens per row); the owner
    tracks that. Capacity grows by an eighth (rounded up to ``GRANULE`` rows) when full: appending one token per
    decode step still costs O(1) on average (a copy of INT2 data every capacity/8 steps), and at most a ninth of
    the buffer is unused. Doubling would leave up to half of it empty: as much again as the INT2 data.
    """

    GROWTH = 1.125
    GRANULE = 256

    def __init__(self, dim: int):
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.rows = 0

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[self.dim]
        if self.data is None:
            self.data = x.clone()
            self.rows = n
            return
        self.slot(n).copy_(x)
        self.rows += n

    def slot(self, n: int) -> torch.Tensor:
        """The next ``n`` rows (capacity grown if needed) as a view to write into; :meth:`advance` then adds them
        (a writer that fails leaves the buffer as it was). Needs a first :meth:`append` (it fixes the shape)."""
        cap = self.data.shape[self.dim]
        if self.rows + n > cap:
            wanted = max(int(self.GROWTH * cap), self.rows + n)
            new_cap = -(-wanted // self.GRANULE) * self.GRANULE
            shape = list(self.data.shape)
            shape[self.dim] = new_cap
            grown = self.data.new_empty(shape)
            grown.narrow(self.dim, 0, self.rows).copy_(self.view())
            self.data = grown
        return self.data.narrow(self.dim, self.rows, n)

    def advance(self, n: int) -> None:
        self.rows += n

    def view(self) -> torch.Tensor | None:
        return None if self.data is None else self.data.narrow(self.dim, 0, self.rows)

    def truncate(self, rows: int) -> None:
        self.rows = min(self.rows, rows)

    def map_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis operation (beam reorder, repeat, select, device move) to the rows in use."""
        if self.data is not None:
            self.data = fn(self.view()).contiguous()
            self.rows = self.data.shape[self.dim]

    @property
    def nbytes(self) -> int:
        v = self.view()
        return 0 if v is None else v.numel() * v.element_size()

    @property
    def allocated_bytes(self) -> int:
        return 0 if self.data is None else self.data.numel() * self.data.element_size()
