"""How the CPU kernels are compiled: Numba's availability, the options every compiled function here shares, a disk
cache keyed by the whole package's source, and the one line a process prints when it compiles.

No function here uses fast-math flags: every sum is taken in the order the code writes it, and a fused multiply-add
happens only where the code calls :func:`~hf_kvint2.cpu_kernels.bits.fma`. A result is then a function of the inputs
alone. That matters because a compiled function called by another exists twice in a process (its own library, and
its copy linked into the caller's), the caller binds to whichever the process loaded first, and LLVM is free to
optimize the two copies to different roundings when fast-math allows it: with fast-math a kernel gave other last
bits when compiled in the process than when loaded from the disk cache. The vector code stays fast by stating its
lanes: four query rows to a vector in the Numba loops, and the intrinsics of :mod:`.lanes`, :mod:`.key_scores` and
:mod:`.value_sums`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
from pathlib import Path

NUMBA = importlib.util.find_spec("numba") is not None
PACKAGE = __name__.rpartition(".")[0]
log = logging.getLogger(PACKAGE)


def available() -> bool:
    """True when Numba is installed (the kernels compile on first use, then load from the disk cache)."""
    return NUMBA


def require_numba() -> None:
    if not NUMBA:
        raise ImportError("The Numba CPU kernel needs numba: pip install 'numba>=0.59' (the clone's '.[cpu]' extra).")


def source_key() -> str:
    """A hash of every module of this package: part of each compiled function's disk-cache key, so that a change to
    any module recompiles every function (Numba alone checks only the file a function is defined in, and a kernel
    inlines functions of other modules)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_dir() -> str:
    """Where the compiled kernels are kept: ``NUMBA_CACHE_DIR``, else ``__pycache__`` next to these modules."""
    return os.environ.get("NUMBA_CACHE_DIR") or str(Path(__file__).parent / "__pycache__")


@contextlib.contextmanager
def compile_lock(name: str):
    """Held around a kernel's first call in a process (:func:`first_call`): processes that start together (test
    workers, tensor-parallel ranks, server workers) compile it once, the others wait here and then load it from the
    disk cache. An exclusive lock on ``<cache dir>/<name>.lock``; nothing where there is no ``fcntl`` (Windows) or
    the cache dir takes no file (read-only: Numba then caches elsewhere)."""
    try:
        import fcntl

        os.makedirs(cache_dir(), exist_ok=True)
        handle = open(os.path.join(cache_dir(), f"{name}.lock"), "a")  # noqa: SIM115 (closed below)
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_called: set = set()  # the keys first_call has called in this process


def first_call(key: tuple, fn, *args):
    """``fn(*args)``, the first time for ``key`` (what picks the compiled specialisation) under
    :func:`compile_lock`, so that a compile another process is running is waited for and loaded, not repeated."""
    if key in _called:
        return fn(*args)
    with compile_lock("-".join(map(str, key))):
        result = fn(*args)
    _called.add(key)
    return result


if NUMBA:
    import numba
    from numba.core import event
    from numba.core.caching import FunctionCache

    _SOURCE_KEY = source_key()

    class _PackageCache(FunctionCache):
        # Numba's disk cache, with the package's source hash in every index key (see source_key).
        def _index_key(self, sig, codegen):
            return (*super()._index_key(sig, codegen), _SOURCE_KEY)

    def njit(fn=None, **options):
        """``numba.njit`` with this package's conventions: GIL released, cached on disk under the package's
        source hash, no fast-math. ``options`` go to Numba (``parallel=...``)."""
        def compile_lazily(py_func):
            dispatcher = numba.njit(nogil=True, **options)(py_func)
            dispatcher._cache = _PackageCache(dispatcher.py_func)  # what cache=True sets, keyed as above
            return dispatcher

        return compile_lazily if fn is None else compile_lazily(fn)

    class _CompileSettings(event.Listener):
        """Around every compile of one of this package's functions: LLVM's superword-level (SLP) vectorizer on
        (Numba leaves it off; the kernels' four query rows per vector come from it, 2-2.7x faster inner loops),
        Numba's setting restored after, and once per process a line saying that the kernels are being compiled.
        Numba sends these events only for real compiles, never for loads from the disk cache."""

        def __init__(self):
            self.depth = 0
            self.before = None
            self.told = False

        def on_start(self, ev):
            if self.depth == 0:
                if not ev.data["dispatcher"].py_func.__module__.startswith(PACKAGE):
                    return
                self.before = numba.config.SLP_VECTORIZE
                numba.config.SLP_VECTORIZE = 1
                if not self.told:
                    self.told = True
                    log.warning("hf_kvint2: compiling the CPU kernels for this model's head_dim (Numba, once: they "
                                "are cached in %s)", cache_dir())
            self.depth += 1

        def on_end(self, ev):
            if self.depth == 0:
                return
            self.depth -= 1
            if self.depth == 0:
                numba.config.SLP_VECTORIZE = self.before

    event.register("numba:compile", _CompileSettings())
