"""OSCAR calibration: capture post-RoPE Q/K/V, stream the key and value metrics, fit rotations, clip ratios,
centering and the per-layer layout; ``OscarCache.calibrate`` builds the cache from the result.

Modules: :mod:`.capture` (observing the model), :mod:`.statistics` (the two passes), :mod:`.fitting`
(candidates and the per-layer choice), :mod:`.confirm` (narrowed ranges checked by the model's loss), :mod:`.run`
(running the steps, the result, its description). Defaults: the windows, group size and reference clips are
``OscarCache``'s (:data:`hf_kvint2.settings.OSCAR_DEFAULTS`), the rest are the ``DEFAULT_*`` constants here;
``OscarCache.calibrate`` and ``calibration_scripts/calibrate_oscar.py`` use them alike.

How it runs:

* **Capture.** The model runs with a temporary attention implementation registered in transformers'
  ``AttentionInterface`` that hands the post-RoPE ``query`` / ``key`` / ``value`` of every layer to a callback
  and then calls the model's own implementation (sdpa, eager, ...) with the same arguments, so the outputs do not
  change. The original implementation is restored afterwards, also on error.
* **Two streaming passes.** The value metric weights token ``t`` by ``k_t^T M_h k_t``, and ``M_h`` (the query
  second moment) is only known after all data. An exact one-pass scheme would need a ``d^4`` tensor per head, so
  the keys and values are visited twice: pass 1 runs the model and accumulates ``sum q q^T`` per KV head and the
  key/value sums (for the means); pass 2, with the final ``M_h``, accumulates ``sum w v v^T``, ``sum w v`` and
  ``sum w``. By default (``value_pass="spill"``) pass 1 writes each window's keys and values (model dtype, exact)
  to a temporary safetensors file on disk that pass 2 reads back, which halves the model forwards;
  ``value_pass="recompute"`` runs the model again instead and needs no disk. Both give identical statistics.
  Accumulators are float64 and their size depends only on layers, heads and ``head_dim``; one window of
  activations is in memory at a time.
* **Held-back windows.** The last ``fit_windows`` windows of the token budget are not used for the statistics;
  pass 1 keeps their keys, values and a sample of queries per layer. Clip ratios and layouts are chosen on them
  by the attention-output error of the quantized cache (sink and recent windows exact, body quantized).

* **Group sizes.** Every candidate is also measured at the other ``group_sizes`` (per-token groups capped at
  ``head_dim``; per-channel key groups of that many tokens), and each layer's K and V stream gets the group size
  that minimises the summed held-back error with the mean bits/element of the quantized body within
  ``bits_budget`` (an exact knapsack over the scale bits; ``bits_budget=None``: ``group_size`` everywhere). The
  chosen sizes are in the layouts the artifact stores per layer.
* **Narrowed ranges, checked end to end.** Per-channel groups may also span only a fraction of their
  ``[min, max]`` (``GroupLayout.range_clip``, fitted like the clips). The attention-output error cannot tell a
  shift that every saturated token shares from noise, so each stream that narrows is then checked by the model's
  loss on the held-back windows (the evaluation's chunked decode, :mod:`hf_kvint2.perplexity`, through the whole
  calibrated cache) and keeps its full range where that loss is lower (:func:`.confirm.confirm_range_clips`;
  ``OscarCache.calibrate`` runs it, and ``calibrate_oscar.py`` is ``OscarCache.calibrate`` with command-line
  arguments). Without the model, the cache type or the held-back token ids nothing is narrowed.

Tokens inside the sink window (the first ``sink_tokens`` of every window) never get quantized, so they are left
out of the key/value statistics (they carry the attention-sink outliers); all queries count.
"""

from .capture import capture_attention, tokenize_texts
from .confirm import confirm_range_clips
from .fitting import (
    CENTERING,
    DEFAULT_BITS_BUDGET,
    DEFAULT_CLIP_GRID,
    DEFAULT_GROUP_SIZES,
    DEFAULT_K_CLIP,
    DEFAULT_RANGE_CLIP_GRID,
    DEFAULT_V_CLIP,
    LAYOUTS,
    Candidate,
    LayerChoice,
    LayerErrorProbe,
    allocate_group_sizes,
    body_bits,
    calibration_from_choices,
    candidate_transforms,
    fit_layer,
    fit_layers,
    settings_from_choices,
    stream_bits,
)
from .run import (
    AUTO_BUDGET,
    CalibrationResult,
    calibration_info,
    calibration_summary,
    fit_calibration,
    fit_from_statistics,
)
from .statistics import (
    DEFAULT_FIT_QUERIES,
    DEFAULT_FIT_WINDOWS,
    DEFAULT_NUM_TOKENS,
    DEFAULT_TEXT_WINDOW,
    DEFAULT_VALUE_PASS,
    CalibrationData,
    HeldOutLayer,
    LayerStatistics,
    collect_statistics,
)

__all__ = [
    "AUTO_BUDGET",
    "CENTERING",
    "DEFAULT_BITS_BUDGET",
    "DEFAULT_CLIP_GRID",
    "DEFAULT_FIT_QUERIES",
    "DEFAULT_FIT_WINDOWS",
    "DEFAULT_GROUP_SIZES",
    "DEFAULT_K_CLIP",
    "DEFAULT_NUM_TOKENS",
    "DEFAULT_RANGE_CLIP_GRID",
    "DEFAULT_TEXT_WINDOW",
    "DEFAULT_VALUE_PASS",
    "DEFAULT_V_CLIP",
    "LAYOUTS",
    "CalibrationData",
    "CalibrationResult",
    "Candidate",
    "HeldOutLayer",
    "LayerChoice",
    "LayerErrorProbe",
    "LayerStatistics",
    "allocate_group_sizes",
    "body_bits",
    "calibration_from_choices",
    "calibration_info",
    "calibration_summary",
    "candidate_transforms",
    "capture_attention",
    "collect_statistics",
    "confirm_range_clips",
    "fit_calibration",
    "fit_from_statistics",
    "fit_layer",
    "fit_layers",
    "settings_from_choices",
    "stream_bits",
    "tokenize_texts",
]
