"""Calibration, step 2: the two streaming passes and their float64 accumulators per layer, plus the held-back
windows used for fitting (see :mod:`hf_kvint2.calibration`)."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..distributed import is_main_process, resolve_shard, tp_group
from ..model_config import model_shape, quantized_layers
from ..settings import OSCAR_DEFAULTS
from .capture import capture_attention, tokenize_texts

# What a calibration reads by default: tokens of text in windows of this many, the last window(s) held back for fitting
# (with this many query rows per layer kept for the error probe); pass 2 reads pass 1's keys and values from disk.
DEFAULT_NUM_TOKENS, DEFAULT_TEXT_WINDOW = 30000, 2048
DEFAULT_FIT_WINDOWS, DEFAULT_FIT_QUERIES = 1, 256
DEFAULT_VALUE_PASS = "spill"

class LayerStatistics:
    """Streaming float64 accumulators of one layer; size O(kv_heads * d^2), independent of the token count.

    Pass 1 (:meth:`add_pass1`): ``sum q q^T`` over tokens and the query heads of each KV head's group, and the
    key/value sums. Pass 2 (:meth:`add_pass2`, after :meth:`finish_pass1`): value weights
    ``w_h[t] = k_t^T M_h k_t`` with the final ``M_h``, and ``sum w v v^T``, ``sum w v``, ``sum w``.
    """

    def __init__(self, kv_heads: int, head_dim: int):
        h, d = kv_heads, head_dim
        f64 = {"dtype": torch.float64}
        self.kv_heads, self.head_dim = h, d
        self.qq = torch.zeros(h, d, d, **f64)
        self.q_count = 0
        self.k_sum, self.v_sum = torch.zeros(h, d, **f64), torch.zeros(h, d, **f64)
        self.kv_count = 0
        self.wvv = torch.zeros(h, d, d, **f64)
        self.wv = torch.zeros(h, d, **f64)
        self.w_sum = torch.zeros(h, **f64)
        self.query_metric: torch.Tensor | None = None  # M_h [H, d, d], fixed by finish_pass1

    _STATE = ("qq", "k_sum", "v_sum", "wvv", "wv", "w_sum", "query_metric")

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qq, self.k_sum, self.v_sum, self.wvv, self.wv, self.w_sum, self.query_metric)
                if t is not None]

    def add_pass1(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``q`` [Hq, n_q, d] (all queries), ``k`` / ``v`` [H, n, d] (tokens eligible for quantization)."""
        h, d = self.kv_heads, self.head_dim
        group = q.shape[0] // h
        qd = q.double().reshape(h, group * q.shape[1], d)  # query head j serves KV head j // group
        self.qq += qd.transpose(1, 2) @ qd
        self.q_count += group * q.shape[1]
        self.k_sum += k.double().sum(1)
        self.v_sum += v.double().sum(1)
        self.kv_count += k.shape[1]

    def finish_pass1(self) -> None:
        if self.q_count == 0 or self.kv_count == 0:
            raise ValueError("Calibration saw no tokens for this layer: give more text or a longer window than "
                             "the sink window.")
        self.query_metric = self.qq / self.q_count

    def add_pass2(self, k: torch.Tensor, v: torch.Tensor) -> None:
        kd, vd = k.double(), v.double()
        w = ((kd @ self.query_metric) * kd).sum(-1)  # [H, n]: k^T M_h k
        self.wvv += (vd * w[..., None]).transpose(1, 2) @ vd
        self.wv += (vd * w[..., None]).sum(1)
        self.w_sum += w.sum(1)

    # ---- results
    def key_mean(self) -> torch.Tensor:
        return self.k_sum / self.kv_count

    def value_mean(self) -> torch.Tensor:
        return self.v_sum / self.kv_count

    def key_metric(self) -> torch.Tensor:
        """Sigma_K = mean_h M_h (qqt). Centering keys does not change it (it only involves queries)."""
        return self.query_metric.mean(0)

    def value_metric(self, centered: bool = False) -> torch.Tensor:
        """Sigma_V = mean_h sum_t w v v^T / sum_t w (sst; weights normalised to mean 1 per head). ``centered``
        uses ``v - mean_v`` (expanded exactly from the same sums)."""
        s = self.wvv
        if centered:
            m, wv, w = self.value_mean(), self.wv, self.w_sum
            s = s - m[:, :, None] * wv[:, None, :] - wv[:, :, None] * m[:, None, :] \
                + w[:, None, None] * m[:, :, None] * m[:, None, :]
        if not (self.w_sum > 0).all():
            raise ValueError("A value-weight sum is zero (all queries or keys zero): cannot form the value metric.")
        return (s / self.w_sum[:, None, None]).mean(0)


@dataclass
class HeldOutLayer:
    """Activations of one held-back window for one layer: sampled queries and all keys/values (float32)."""

    q: torch.Tensor  # [Hq, n_q, d]
    k: torch.Tensor  # [H, T, d]
    v: torch.Tensor  # [H, T, d]
    positions: torch.Tensor  # [n_q] positions of the sampled queries in the window
    scaling: float


@dataclass
class CalibrationData:
    """Everything the two passes produced (statistics per layer, held-back windows) and how they were made."""

    stats: list[LayerStatistics | None]  # None: a layer not calibrated (not quantized by the cache)
    held_out: list[list[HeldOutLayer | None]]  # [window][layer]
    num_layers: int
    kv_heads: int
    head_dim: int
    info: dict = field(default_factory=dict)
    # the token ids of the held-back windows ([text_window] each): what the fit's end-to-end check runs the model
    # on (statistics saved before they were recorded have none)
    held_ids: list[torch.Tensor] = field(default_factory=list)

    @property
    def calibrated_layers(self) -> list[int]:
        """The layers with statistics: those the cache quantizes (full attention; not sliding-window layers)."""
        return [i for i, s in enumerate(self.stats) if s is not None]

    def save(self, path) -> None:
        """Write everything to one safetensors file (for re-fitting variants without re-running the model)."""
        from safetensors.torch import save_file

        tensors = {f"stats.{i}.{n}": getattr(s, n) for i, s in enumerate(self.stats) if s is not None
                   for n in LayerStatistics._STATE if getattr(s, n) is not None}
        scaling = []
        for w, layers in enumerate(self.held_out):
            scaling.append([None if h is None else h.scaling for h in layers])
            for i, h in enumerate(layers):
                if h is None:
                    continue
                tensors.update({f"held.{w}.{i}.{n}": getattr(h, n).clone(memory_format=torch.contiguous_format) for n in ("q", "k", "v", "positions")})
        tensors.update({f"held_ids.{w}": ids.clone() for w, ids in enumerate(self.held_ids)})
        meta = {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "info": self.info, "counts": [None if s is None else (s.q_count, s.kv_count) for s in self.stats],
                "scaling": scaling}
        save_file(tensors, str(path), metadata={"calibration_data": json.dumps(meta)})

    @classmethod
    def load(cls, path) -> CalibrationData:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["calibration_data"])
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        stats = []
        for i, counts in enumerate(meta["counts"]):
            if counts is None:
                stats.append(None)
                continue
            q_count, kv_count = counts
            s = LayerStatistics(meta["kv_heads"], meta["head_dim"])
            for n in LayerStatistics._STATE:
                setattr(s, n, t.get(f"stats.{i}.{n}"))
            s.q_count, s.kv_count = q_count, kv_count
            stats.append(s)
        held = [[None if sc is None else HeldOutLayer(*(t[f"held.{w}.{i}.{n}"] for n in ("q", "k", "v", "positions")),
                                                      sc)
                 for i, sc in enumerate(layer_scaling)] for w, layer_scaling in enumerate(meta["scaling"])]
        held_ids = [t[f"held_ids.{w}"] for w in range(len(held)) if f"held_ids.{w}" in t]
        return cls(stats, held, meta["num_layers"], meta["kv_heads"], meta["head_dim"], meta["info"],
                   held_ids if len(held_ids) == len(held) else [])


def _query_positions(text_window: int, count: int, sink: int, recent: int) -> torch.Tensor:
    """Sampled query positions in the second half of a text window, all late enough to see quantized keys."""
    first = max(text_window // 2, sink + recent + 1)
    if first >= text_window:
        raise ValueError(f"A text window of {text_window} tokens has no quantized body for sink_tokens={sink} and "
                         f"recent_tokens={recent}: use text_window > {sink + recent + 1} to fit clips and layouts.")
    return torch.linspace(first, text_window - 1, min(count, text_window - first)).round().long().unique()


def _peak_memory_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def collect_statistics(model, tokenizer, texts: Sequence[str], *, num_tokens: int = DEFAULT_NUM_TOKENS,
                       text_window: int = DEFAULT_TEXT_WINDOW, fit_windows: int = DEFAULT_FIT_WINDOWS,
                       fit_queries: int = DEFAULT_FIT_QUERIES, sink_tokens: int = OSCAR_DEFAULTS.sink_tokens,
                       recent_tokens: int = OSCAR_DEFAULTS.recent_tokens, value_pass: str = DEFAULT_VALUE_PASS,
                       spill_dir: str | None = None, layers: Sequence[int] | None = None,
                       progress: bool = True) -> CalibrationData:
    """Run the two capture passes (see the module docstring) and return the accumulated statistics.

    ``layers``: the layer indices to calibrate; default :func:`quantized_layers` (the full-attention layers: the
    caches keep sliding-window layers as transformers' full-precision window, so their statistics would go
    unused, and fitting them against full causal attention would measure an error their attention never sees)."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    if value_pass not in ("spill", "recompute"):
        raise ValueError(f"value_pass must be 'spill' (keys/values to a temporary file) or 'recompute' (run the "
                         f"model twice), got {value_pass!r}.")

    num_layers, _q_heads, kv_heads, head_dim = model_shape(model.config)
    wanted = quantized_layers(model.config) if layers is None else sorted(set(layers))
    if not wanted or any(not isinstance(i, int) or not 0 <= i < num_layers for i in wanted):
        raise ValueError(f"layers must be a non-empty list of layer indices in [0, {num_layers}), got {layers!r}.")
    # Tensor parallelism: this rank captures its slice of the query and KV heads; the per-head statistics are
    # gathered at the end, so that every rank fits the artifact one process would fit.
    shard = resolve_shard(model.config, tp_group(model))
    local_kv_heads = kv_heads // shard.world_size if shard is not None else kv_heads
    progress = progress and is_main_process()
    if text_window <= sink_tokens:
        raise ValueError(f"text_window={text_window} must exceed sink_tokens={sink_tokens}.")
    ids = tokenize_texts(tokenizer, texts, num_tokens)
    held_tokens = fit_windows * text_window
    stat_tokens = len(ids) - held_tokens
    if stat_tokens <= sink_tokens:
        raise ValueError(
            f"The texts give {len(ids)} tokens, but {fit_windows} held-back window(s) of {text_window} tokens plus "
            f"statistics need more than {held_tokens + sink_tokens}. Give more text, a smaller text_window, or "
            "fit_windows=0 (no clip fitting or layout choice: --no-fit-clip with a single layout).")
    stat_windows = [ids[i: i + text_window] for i in range(0, stat_tokens, text_window)]
    held_windows = [ids[stat_tokens + i * text_window: stat_tokens + (i + 1) * text_window] for i in range(fit_windows)]
    positions = _query_positions(text_window, fit_queries, sink_tokens, recent_tokens) if fit_windows else None

    stats = [LayerStatistics(local_kv_heads, head_dim) if idx in wanted else None for idx in range(num_layers)]
    held_out: list[list[HeldOutLayer | None]] = []
    device = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # no LM head: logits are not needed
    state = {"pass": 1, "held": None}
    spilled: dict[str, torch.Tensor] = {}  # this window's keys/values, written to disk after the window

    def on_attention(module, query, key, value, kwargs):
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise RuntimeError(f"{type(module).__name__} has no layer_idx; cannot attribute its activations.")
        if stats[idx] is None:  # not calibrated (a sliding-window layer)
            return
        if query.shape[0] != 1 or key.shape[1] != local_kv_heads or key.shape[-1] != head_dim or \
                value.shape != key.shape:
            raise RuntimeError(f"Layer {idx}: unexpected attention shapes q={tuple(query.shape)} "
                               f"k={tuple(key.shape)} v={tuple(value.shape)} (expected batch 1, {local_kv_heads} KV "
                               f"heads, head_dim {head_dim}, equal K/V shapes).")
        q, k, v = query[0], key[0, :, sink_tokens:], value[0, :, sink_tokens:]
        if state["held"] is not None:
            scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or head_dim ** -0.5
            state["held"][idx] = HeldOutLayer(q[:, positions].float().cpu(), key[0].float().cpu(),
                                              value[0].float().cpu(), positions, float(scaling))
        elif state["pass"] == 1:
            stats[idx].add_pass1(q, k, v)
            if value_pass == "spill":
                spilled[f"{idx}.k"], spilled[f"{idx}.v"] = k.cpu().contiguous(), v.cpu().contiguous()
        else:
            stats[idx].add_pass2(k, v)

    total = sum(len(w) for w in stat_windows) * 2 + held_tokens
    start = time.perf_counter()
    with torch.inference_mode(), capture_attention(model, on_attention), \
            tempfile.TemporaryDirectory(prefix="hf_kvint2_calibration_", dir=spill_dir) as spill_folder, \
            tqdm(total=total, unit="tok", desc="OSCAR calibration", disable=not progress) as bar:
        for pass_no in (1, 2):
            state["pass"] = pass_no
            bar.set_postfix_str(f"pass {pass_no}/2" + (" (from disk)" if pass_no == 2 and value_pass == "spill"
                                                        else ""))
            for i, w in enumerate(stat_windows):
                path = os.path.join(spill_folder, f"window{i}.safetensors")
                if pass_no == 2 and value_pass == "spill":
                    kv = load_file(path)
                    for idx in wanted:
                        stats[idx].add_pass2(kv[f"{idx}.k"].to(device), kv[f"{idx}.v"].to(device))
                    del kv
                    os.remove(path)
                else:
                    decoder(input_ids=w[None].to(device), use_cache=False)
                    if spilled:
                        if len(spilled) != 2 * len(wanted):
                            raise RuntimeError(f"Captured {len(spilled) // 2} of {len(wanted)} layers: some attention "
                                               "layers do not go through transformers' attention interface.")
                        save_file(spilled, path)
                        spilled.clear()
                bar.update(len(w))
            if pass_no == 1:
                for s in stats:
                    if s is not None:
                        s.finish_pass1()
                for w in held_windows:  # captured raw; rotations are applied when fitting
                    state["held"] = [None] * num_layers
                    decoder(input_ids=w[None].to(device), use_cache=False)
                    missing = [idx for idx in wanted if state["held"][idx] is None]
                    if missing:
                        raise RuntimeError(f"Layers {missing} were not captured on the held-back window: some "
                                           "attention layers do not go through transformers' attention interface.")
                    held_out.append(state["held"])
                    state["held"] = None
                    bar.update(len(w))
    info = {
        "num_tokens": len(ids),
        "statistics_tokens": int(stat_tokens),
        "held_out_tokens": int(held_tokens),
        "window": text_window,
        "token_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        "seconds_capture": time.perf_counter() - start,
    }
    if shard is not None:
        _gather_heads(stats, held_out, shard)
    return CalibrationData(stats, held_out, num_layers, kv_heads, head_dim, info,
                           [w.clone() for w in held_windows] if held_out else [])


def _gather_heads(stats: list[LayerStatistics], held_out: list[list[HeldOutLayer]], shard) -> None:
    """Tensor parallelism: replace every rank's per-head statistics and held-back activations by all heads.

    Rank r holds the contiguous KV heads [r H / n, (r + 1) H / n) and their query heads (transformers shards
    q/k/v projections column-wise), so concatenating in rank order gives the global head order. Token counts
    are per head and the same on every rank.
    """
    for s in stats:
        if s is None:
            continue
        for name in ("qq", "k_sum", "v_sum", "wvv", "wv", "w_sum", "query_metric"):
            setattr(s, name, shard.all_gather_heads(getattr(s, name)))
        s.kv_heads = shard.global_kv_heads
    for window in held_out:
        for layer in window:
            if layer is None:
                continue
            layer.q, layer.k, layer.v = (shard.all_gather_heads(t) for t in (layer.q, layer.k, layer.v))
