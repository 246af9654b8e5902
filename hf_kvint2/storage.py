"""Growable token-axis buffers for the INT2 body (amortised O(1) appends instead of a ``torch.cat`` per step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy


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
        self._data: torch.Tensor | None = None
        self._array = None  # numpy view of _data (array())
        self.rows = 0

    @property
    def data(self) -> torch.Tensor | None:
        """The whole buffer (``rows`` in use, the rest spare capacity)."""
        return self._data

    @data.setter
    def data(self, value: torch.Tensor | None) -> None:
        self._data, self._array = value, None

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) gets a new tensor: the numpy view of the old one must not travel with it, or a
        # writer would fill the copy of an array instead of the buffer.
        return {**self.__dict__, "_array": None}

    def array(self) -> numpy.ndarray:
        """The whole buffer as a numpy array sharing its memory (16-bit floats as their int16 bits), made once per
        buffer: a compiled writer's output (a decode step pays no conversion). CPU only."""
        if self._array is None:
            t = self._data.view(torch.int16) if self._data.dtype in (torch.float16, torch.bfloat16) else self._data
            self._array = t.numpy()
        return self._array

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
        self.reserve(n)
        return self.data.narrow(self.dim, self.rows, n)

    def reserve(self, n: int) -> torch.Tensor:
        """Capacity for ``n`` more rows (grown if needed); returns the whole buffer ``data``, whose rows from
        ``rows`` on a writer may fill before :meth:`advance`. Needs a first :meth:`append`."""
        cap = self.data.shape[self.dim]
        if self.rows + n > cap:
            wanted = max(int(self.GROWTH * cap), self.rows + n)
            new_cap = -(-wanted // self.GRANULE) * self.GRANULE
            shape = list(self.data.shape)
            shape[self.dim] = new_cap
            grown = self.data.new_empty(shape)
            grown.narrow(self.dim, 0, self.rows).copy_(self.view())
            self.data = grown
        return self.data

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
