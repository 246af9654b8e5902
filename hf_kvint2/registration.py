"""Registers the ``"oscar"`` attention with transformers without importing transformers on ``import hf_kvint2``.

The registration needs transformers' model code (``AttentionInterface`` lives in ``transformers.modeling_utils``),
which takes seconds to import. If it is already loaded, the attention is registered at once; otherwise a
post-import hook registers it right after ``transformers.modeling_utils`` finishes loading, i.e. before any model
can be built.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings

TRIGGER = "transformers.modeling_utils"


def _register() -> None:
    attention = sys.modules.get(f"{__package__}.attention")
    if attention is not None and not hasattr(attention, "register"):
        return  # hf_kvint2.attention is mid-import (it imported transformers); it registers itself when done
    from .attention import register

    register()


class _RegisteringLoader(importlib.abc.Loader):
    """Delegates to transformers' own loader, then registers the attention."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _remove_hook()
        try:
            _register()
        except (ImportError, AttributeError, TypeError, ValueError) as err:  # never break transformers
            warnings.warn(f"hf_kvint2 could not register the 'oscar' attention with transformers: {err!r}",
                          stacklevel=2)


class _PostImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TRIGGER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportHook)]


def register_when_transformers_loads() -> None:
    """Register ``"oscar"`` now if transformers' model code is loaded, else as soon as it is (idempotent)."""
    if TRIGGER in sys.modules:
        _register()
    elif not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook())
