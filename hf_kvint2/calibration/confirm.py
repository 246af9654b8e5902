"""Calibration, step 3b: narrowed group ranges checked end to end, by the model's loss through the calibrated cache
(see :mod:`hf_kvint2.calibration`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..backends import cpu_body
from ..perplexity import CacheMethod, chunked_perplexity
from .fitting import LayerChoice, calibration_from_choices, settings_from_choices


def confirm_range_clips(choices: Sequence[LayerChoice | None], model, held_ids: Sequence[torch.Tensor], *,
                        cache_type, sink_tokens: int, recent_tokens: int, group_size: int, scale_dtype: torch.dtype,
                        head_dim: int, progress: bool = True) -> tuple[list[LayerChoice | None], dict | None]:
    """Keep each stream's narrowed group range (:attr:`GroupLayout.range_clip`) only where the model's loss on the
    held-back windows says it pays.

    The held-back attention error measures how far each output moves, not which way: narrowing a range saturates a
    group's extreme tokens, a shift of the same sign for every one of them, and where those tokens are what
    attention looks for (Gemma 3's first full-attention layer) the error falls while perplexity rises by several
    percent. So the windows are decoded by the evaluation's chunked protocol (:mod:`hf_kvint2.perplexity`: prefill
    a quarter, chunks of a sixteenth) through the whole calibrated cache (a ``cache_type``, e.g. ``OscarCache``,
    built from the choices; its body read by the PyTorch backend), once as fitted and once per narrowed stream with
    that stream's full range; a stream keeps its narrowed range only if its full range gives a higher loss. Returns
    the choices and what was measured (None: nothing narrowed).
    """
    streams = [(i, kind) for i, c in enumerate(choices) if c is not None for kind in ("key", "value")
               if getattr(c, kind).layout.range_clip is not None]
    if not streams:
        return list(choices), None

    def widened(drop) -> list[LayerChoice | None]:
        out = list(choices)
        for i, kind in drop:
            c = out[i]
            cand = getattr(c, kind)
            full = replace(cand, layout=replace(cand.layout, range_clip=None))
            size = cand.layout.group_size
            name = f"{kind}:{cand.name}@None" + ("" if size == min(group_size, head_dim) else f"/g{size}")
            out[i] = replace(c, **{kind: full, f"{kind}_error": c.errors.get(name, float("nan"))})
        return out

    def method(name, ch):
        settings = settings_from_choices(ch, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                         group_size=group_size, scale_dtype=scale_dtype)
        calibration = calibration_from_choices(ch)
        return CacheMethod(name, name, lambda cfg: cache_type(cfg, settings=settings, calibration=calibration))

    variants = {"fitted": list(choices), **{f"{i}:{kind}": widened([(i, kind)]) for i, kind in streams}}
    windows = torch.stack(list(held_ids)).long()
    window = windows.shape[1]
    prefill, chunk = window // 4, max(1, window // 16)
    # The PyTorch body: a few chunks per variant, where the Numba kernel might first have to compile for this
    # head_dim (the same codes, another summation order).
    # A variant differs from the fitted cache from its layer on: the layers before it are replayed, not run again.
    with cpu_body("torch"):
        results = chunked_perplexity(model, windows, [method(n, ch) for n, ch in variants.items()], prefill, chunk,
                                     progress=progress, same_first_layers={f"{i}:{kind}": i for i, kind in streams})
    nll = {n: math.log(r.perplexity) for n, r in results.items()}
    drop = [(i, kind) for i, kind in streams if nll[f"{i}:{kind}"] < nll["fitted"]]
    report = {"method": "held-back loss (chunked decode: prefill window/4, chunks window/16) of the calibrated "
                        "cache as fitted and with each narrowed stream at its full range",
              "held_back_nll": nll,
              "kept": [f"{i}:{kind}" for i, kind in streams if (i, kind) not in drop],
              "widened": [f"{i}:{kind}" for i, kind in drop]}
    return widened(drop), report
