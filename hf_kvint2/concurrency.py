"""One thread at a time: the check that refuses concurrent use of a cache instead of letting it corrupt.

A cache, like transformers' ``DynamicCache``, is not thread-safe: two threads that update it at once interleave their
tokens (layers of different lengths, shape errors, NaN attention). Locking would serialise two sequences into one
cache, which is wrong as well, so the caches detect it and refuse, naming the fix (a cache per thread).

What counts as concurrent use (:class:`ThreadGuard`, checked at every ``update``): an update while another thread's
update is in progress, or an update by a thread other than the last one unless the last one had finished a forward
(its last update was at the highest layer index updated so far) and this one starts a forward (it is at the lowest
one). So one thread after another (a server's pool handing a cache on between requests) is fine. Once detected, the
cache refuses every update until ``reset()``: its contents are undefined. What it cannot see: threads that
alternate exactly at forward boundaries (each sees the other's tokens), and overlapping forwards of a one-layer model
unless two updates overlap; see docs/robustness.md.
"""

from __future__ import annotations

import threading

_get_ident = threading.get_ident


class ThreadGuard:
    """The concurrent-use check of one cache: :meth:`enter` before a layer's update (when another thread or an
    update in progress may be involved), :meth:`leave` after it. A plain object with plain fields: caches that hold
    it pickle and deepcopy."""

    def __init__(self):
        self.thread: int | None = None  # the thread of the last update
        self.layer = -1  # its layer index
        self.top = -1  # the highest layer index updated so far (a forward's last layer)
        self.bottom = -1  # the lowest (a forward's first layer)
        self.busy = False  # an update is in progress
        self.broken: str | None = None  # why the cache refuses updates (concurrent use was seen)

    def enter(self, layer_idx: int, owner: str) -> None:
        """Take the cache for this thread, or raise if another thread is using it (and refuse it from then on)."""
        thread = _get_ident()
        if self.broken is None:
            if self.busy:
                self.broken = f"an update of layer {layer_idx} began while another update was in progress"
            elif self.thread not in (None, thread) and not (self.layer == self.top and layer_idx <= self.bottom):
                self.broken = (f"thread {thread} updated layer {layer_idx} while the forward of thread {self.thread} "
                               f"had updated layers up to {self.layer} of {self.bottom}..{self.top}")
        if self.broken is not None:
            raise RuntimeError(
                f"{owner} was used by two threads at once ({self.broken}). A cache, like transformers' "
                "DynamicCache, holds one sequence batch and is not thread-safe: give each thread its own cache. "
                "Its contents are now undefined, so it refuses updates until cache.reset() (a forward that failed "
                "midway in one thread and continued in another also leaves it so).")
        self.thread = thread

    def leave(self, layer_idx: int) -> None:
        self.busy = False
        self.layer = layer_idx
        self.top = max(self.top, layer_idx)
        if layer_idx < self.bottom or self.bottom < 0:
            self.bottom = layer_idx

    def reset(self) -> None:
        """A reset cache holds nothing: any thread may start on it."""
        self.thread, self.layer, self.busy, self.broken = None, -1, False, None
