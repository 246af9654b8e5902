"""OSCAR calibration (SPEC 3): capture post-RoPE Q/K/V, stream the key and value metrics, fit rotations, clip
ratios, centering and the per-layer layout, and build a ready :class:`~hf_kvint2.OscarCache`.

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

Tokens inside the sink window (the first ``sink_tokens`` of every window) never get quantized, so they are left
out of the key/value statistics (they carry the attention-sink outliers); all queries count.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .distributed import is_main_process, resolve_shard, tp_group
from .layers import QuantizedStream
from .recipes import GroupLayout
from .transforms import hadamard_matrix, spectral_rotation

LAYOUTS = ("spectral", "hadamard", "channel")
DEFAULT_CLIP_GRID = (0.86, 0.89, 0.92, 0.94, 0.96, 0.98, 1.0)
DEFAULT_K_CLIP, DEFAULT_V_CLIP = 0.96, 0.92

# ---------------------------------------------------------------------------------------------- capture
_CAPTURE_PREFIX = "hf_kvint2_capture_"
_active_callbacks: list[Callable] = []


def _original_attention(module, implementation: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation == "eager":
        if eager is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward in its modeling file; "
                               "load the model with attn_implementation='sdpa' for calibration.")
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


def _capture_name(implementation: str) -> str:
    """Register (once) a recording wrapper around ``implementation`` and its mask function; return its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _CAPTURE_PREFIX + implementation
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        if _active_callbacks:
            _active_callbacks[-1](module, query, key, value, kwargs)
        return _original_attention(module, implementation)(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, recording_attention)
    if implementation in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # same masks as the original
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


@contextlib.contextmanager
def capture_attention(model, callback: Callable):
    """Within the block, every attention call of ``model`` first calls ``callback(module, query, key, value,
    kwargs)`` with post-RoPE ``query`` [B, Hq, T, d] and ``key`` / ``value`` [B, Hkv, T, d], then runs the model's
    own attention implementation unchanged."""
    original = model.config._attn_implementation
    if original is None or original.startswith(_CAPTURE_PREFIX):
        raise RuntimeError(f"Cannot capture attention: the model's attn_implementation is {original!r}.")
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        raise ValueError(f"{type(model).__name__} does not dispatch attention through transformers' "
                         "AttentionInterface, so OSCAR calibration cannot observe its post-RoPE queries and keys.")
    model.set_attn_implementation(_capture_name(original))
    _active_callbacks.append(callback)
    try:
        yield
    finally:
        _active_callbacks.remove(callback)
        model.set_attn_implementation(original)


# ---------------------------------------------------------------------------------------------- statistics
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

    stats: list[LayerStatistics]
    held_out: list[list[HeldOutLayer]]  # [window][layer]
    num_layers: int
    kv_heads: int
    head_dim: int
    info: dict = field(default_factory=dict)

    def save(self, path) -> None:
        """Write everything to one safetensors file (for re-fitting variants without re-running the model)."""
        from safetensors.torch import save_file

        tensors = {f"stats.{i}.{n}": getattr(s, n) for i, s in enumerate(self.stats) for n in LayerStatistics._STATE
                   if getattr(s, n) is not None}
        scaling = []
        for w, layers in enumerate(self.held_out):
            scaling.append([h.scaling for h in layers])
            for i, h in enumerate(layers):
                tensors.update({f"held.{w}.{i}.{n}": getattr(h, n).clone(memory_format=torch.contiguous_format) for n in ("q", "k", "v", "positions")})
        meta = {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "info": self.info, "counts": [(s.q_count, s.kv_count) for s in self.stats], "scaling": scaling}
        save_file(tensors, str(path), metadata={"calibration_data": json.dumps(meta)})

    @classmethod
    def load(cls, path) -> CalibrationData:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["calibration_data"])
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        stats = []
        for i, (q_count, kv_count) in enumerate(meta["counts"]):
            s = LayerStatistics(meta["kv_heads"], meta["head_dim"])
            for n in LayerStatistics._STATE:
                setattr(s, n, t.get(f"stats.{i}.{n}"))
            s.q_count, s.kv_count = q_count, kv_count
            stats.append(s)
        held = [[HeldOutLayer(*(t[f"held.{w}.{i}.{n}"] for n in ("q", "k", "v", "positions")), sc)
                 for i, sc in enumerate(layer_scaling)] for w, layer_scaling in enumerate(meta["scaling"])]
        return cls(stats, held, meta["num_layers"], meta["kv_heads"], meta["head_dim"], meta["info"])


def tokenize_texts(tokenizer, texts: Sequence[str], num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` token ids of the texts, tokenized one by one without special tokens (windows are
    slices of this stream) and concatenated. ``tokenizer`` needs ``encode(text, add_special_tokens=False)``."""
    if isinstance(texts, str):
        texts = [texts]
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError("texts must be a non-empty list of non-empty strings (the calibration corpus).")
    ids: list[int] = []
    for text in texts:
        try:  # verbose=False: transformers tokenizers would warn that the text exceeds the model's length
            ids.extend(tokenizer.encode(text, add_special_tokens=False, verbose=False))
        except TypeError:
            ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= num_tokens:
            break
    return torch.tensor(ids[:num_tokens], dtype=torch.long)


def _query_positions(window: int, count: int, sink: int, recent: int) -> torch.Tensor:
    """Sampled query positions in the second half of a window, all late enough to see quantized keys."""
    first = max(window // 2, sink + recent + 1)
    if first >= window:
        raise ValueError(f"A window of {window} tokens has no quantized body for sink_tokens={sink} and "
                         f"recent_tokens={recent}: use window > {sink + recent + 1} to fit clips and layouts.")
    return torch.linspace(first, window - 1, min(count, window - first)).round().long().unique()


def _model_shape(model) -> tuple[int, int, int, int]:
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads, kv, head_dim


def _peak_memory_bytes(device) -> int:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def collect_statistics(model, tokenizer, texts: Sequence[str], *, num_tokens: int = 30000, window: int = 2048,
                       fit_windows: int = 1, fit_queries: int = 256, sink_tokens: int = 64,
                       recent_tokens: int = 256, value_pass: str = "spill", spill_dir: str | None = None,
                       progress: bool = True) -> CalibrationData:
    """Run the two capture passes (see the module docstring) and return the accumulated statistics."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    if value_pass not in ("spill", "recompute"):
        raise ValueError(f"value_pass must be 'spill' (keys/values to a temporary file) or 'recompute' (run the "
                         f"model twice), got {value_pass!r}.")

    num_layers, _q_heads, kv_heads, head_dim = _model_shape(model)
    # Tensor parallelism: this rank captures its slice of the query and KV heads; the per-head statistics are
    # gathered at the end, so that every rank fits the artifact one process would fit.
    shard = resolve_shard(model.config, tp_group(model))
    local_kv_heads = kv_heads // shard.world_size if shard is not None else kv_heads
    progress = progress and is_main_process()
    if window <= sink_tokens:
        raise ValueError(f"window={window} must exceed sink_tokens={sink_tokens}.")
    ids = tokenize_texts(tokenizer, texts, num_tokens)
    held_tokens = fit_windows * window
    stat_tokens = len(ids) - held_tokens
    if stat_tokens <= sink_tokens:
        raise ValueError(
            f"The texts give {len(ids)} tokens, but {fit_windows} held-back window(s) of {window} tokens plus "
            f"statistics need more than {held_tokens + sink_tokens}. Give more text, a smaller window, or "
            "fit_windows=0 (no clip fitting or layout choice: --no-fit-clip with a single layout).")
    stat_windows = [ids[i: i + window] for i in range(0, stat_tokens, window)]
    held_windows = [ids[stat_tokens + i * window: stat_tokens + (i + 1) * window] for i in range(fit_windows)]
    positions = _query_positions(window, fit_queries, sink_tokens, recent_tokens) if fit_windows else None

    stats = [LayerStatistics(local_kv_heads, head_dim) for _ in range(num_layers)]
    held_out: list[list[HeldOutLayer | None]] = []
    device = next(model.parameters()).device
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model  # no LM head: logits are not needed
    state = {"pass": 1, "held": None}
    spilled: dict[str, torch.Tensor] = {}  # this window's keys/values, written to disk after the window

    def on_attention(module, query, key, value, kwargs):
        idx = getattr(module, "layer_idx", None)
        if idx is None:
            raise RuntimeError(f"{type(module).__name__} has no layer_idx; cannot attribute its activations.")
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
                    for idx in range(num_layers):
                        stats[idx].add_pass2(kv[f"{idx}.k"].to(device), kv[f"{idx}.v"].to(device))
                    del kv
                    os.remove(path)
                else:
                    decoder(input_ids=w[None].to(device), use_cache=False)
                    if spilled:
                        if len(spilled) != 2 * num_layers:
                            raise RuntimeError(f"Captured {len(spilled) // 2} of {num_layers} layers: some attention "
                                               "layers do not go through transformers' attention interface.")
                        save_file(spilled, path)
                        spilled.clear()
                bar.update(len(w))
            if pass_no == 1:
                for s in stats:
                    s.finish_pass1()
                for w in held_windows:  # captured raw; rotations are applied when fitting
                    state["held"] = [None] * num_layers
                    decoder(input_ids=w[None].to(device), use_cache=False)
                    held_out.append(state["held"])
                    state["held"] = None
                    bar.update(len(w))
    info = {
        "num_tokens": len(ids),
        "statistics_tokens": int(stat_tokens),
        "held_out_tokens": int(held_tokens),
        "window": window,
        "token_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        "seconds_capture": time.perf_counter() - start,
    }
    if shard is not None:
        _gather_heads(stats, held_out, shard)
    return CalibrationData(stats, held_out, num_layers, kv_heads, head_dim, info)


def _gather_heads(stats: list[LayerStatistics], held_out: list[list[HeldOutLayer]], shard) -> None:
    """Tensor parallelism: replace every rank's per-head statistics and held-back activations by all heads.

    Rank r holds the contiguous KV heads [r H / n, (r + 1) H / n) and their query heads (transformers shards
    q/k/v projections column-wise), so concatenating in rank order gives the global head order. Token counts
    are per head and the same on every rank.
    """
    for s in stats:
        for name in ("qq", "k_sum", "v_sum", "wvv", "wv", "w_sum", "query_metric"):
            setattr(s, name, shard.all_gather_heads(getattr(s, name)))
        s.kv_heads = shard.global_kv_heads
    for window in held_out:
        for layer in window:
            layer.q, layer.k, layer.v = (shard.all_gather_heads(t) for t in (layer.q, layer.k, layer.v))


# ---------------------------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class Candidate:
    """One way to store K or V of a layer: a layout, its rotation and (optional) mean, and a name."""

    name: str
    layout: GroupLayout
    rotation: torch.Tensor
    mean: torch.Tensor | None
    eigenvalues: torch.Tensor | None = None


def candidate_transforms(stats: LayerStatistics, kind: str, layout: str, centered: bool, head_dim: int):
    """(rotation [d, d] float32, mean [H, d] float32 or None, eigenvalues or None) of a layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}; choose from {LAYOUTS}.")
    mean = (stats.key_mean() if kind == "key" else stats.value_mean()).float() if centered else None
    if layout == "spectral":
        sigma = stats.key_metric() if kind == "key" else stats.value_metric(centered)
        rot, evals = spectral_rotation(sigma)
        return rot.float(), mean, evals.float()
    if layout == "hadamard":
        return hadamard_matrix(head_dim), mean, None
    return torch.eye(head_dim), mean, None  # per-channel (KIVI-style): channels kept as they are


class LayerErrorProbe:
    """Attention-output error of a quantized K or V on the held-back windows of one layer.

    Per window the cache is simulated as it is at decode time: keys/values before ``sink`` and within the
    ``recent`` tokens before each query are exact, the rest is stored as the candidate stores it. The error is
    ``sum ||o_hat - o||^2 / sum ||o||^2`` over sampled queries and query heads.
    """

    def __init__(self, held: Sequence[HeldOutLayer], sink: int, recent: int, scale_dtype: torch.dtype):
        self.sink, self.recent, self.scale_dtype = sink, recent, scale_dtype
        self.windows = []
        for w in held:
            h, t, d = w.k.shape
            group = w.q.shape[0] // h
            q = w.q.reshape(h, group * w.q.shape[1], d)
            pos = w.positions.repeat(group)  # row r of q belongs to position positions[r % n_q]
            j = torch.arange(t)
            causal = j[None, :] <= pos[:, None]
            body = (j[None, :] >= sink) & (j[None, :] <= pos[:, None] - recent) & causal
            scores = (q @ w.k.transpose(1, 2)) * w.scaling
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = scores.softmax(-1)
            out = probs @ w.v
            self.windows.append({"w": w, "q": q, "causal": causal, "body": body, "scores": scores, "probs": probs,
                                 "out": out, "norm": out.square().sum().item()})

    def _quantized(self, x: torch.Tensor, cand: Candidate) -> torch.Tensor:
        """x [H, T, d] with tokens from ``sink`` on replaced by their stored (quantize -> dequantize) form."""
        d = x.shape[-1]
        group = cand.layout.group_for(d)
        n = x.shape[1] - self.sink
        if cand.layout.axis == "channel":
            n -= n % group  # whole token blocks only; the rest is still in the recent window
        stream = QuantizedStream(cand.layout, group, cand.rotation, cand.mean, self.scale_dtype)
        stream.append(x[None, :, self.sink: self.sink + n])
        out = x.clone()
        out[:, self.sink: self.sink + n] = stream.dequantize()[0]
        return out

    def error(self, kind: str, cand: Candidate) -> float:
        num = den = 0.0
        for win in self.windows:
            w = win["w"]
            if kind == "key":
                k_hat = self._quantized(w.k, cand)
                s_hat = (win["q"] @ k_hat.transpose(1, 2)) * w.scaling
                s = torch.where(win["body"], s_hat, win["scores"])
                diff = s.softmax(-1) @ w.v - win["out"]
            else:
                dv = self._quantized(w.v, cand) - w.v
                diff = (win["probs"] * win["body"]) @ dv
            num += diff.square().sum().item()
            den += win["norm"]
        return num / den if den > 0 else 0.0


@dataclass
class LayerChoice:
    """What calibration chose for one layer, and the errors it measured."""

    key: Candidate
    value: Candidate
    key_error: float
    value_error: float
    errors: dict = field(default_factory=dict)  # "key:<name>@<clip>" -> error, same for values


def _candidate_name(layout: str, centered: bool) -> str:
    return layout + ("+center" if centered else "")


def fit_layer(stats: LayerStatistics, probe: LayerErrorProbe | None, head_dim: int, *, layouts=LAYOUTS,
              centering=(False, True), fit_clip: bool = True, clip_grid=DEFAULT_CLIP_GRID, group_size: int = 128,
              k_clip: float = DEFAULT_K_CLIP, v_clip: float = DEFAULT_V_CLIP) -> LayerChoice:
    """Pick the key and the value candidate with the lowest attention-output error (first wins ties)."""
    if probe is None and (fit_clip or len(layouts) * len(centering) > 1):
        raise ValueError("Fitting clips or choosing among layouts needs held-back windows (fit_windows >= 1).")
    chosen, errors = {}, {}
    for kind, default_clip in (("key", k_clip), ("value", v_clip)):
        best = None
        for layout in layouts:
            for centered in centering:
                rot, mean, evals = candidate_transforms(stats, kind, layout, centered, head_dim)
                if layout == "channel":  # per-channel groups over tokens: same scale count as per-token groups
                    clips = [None]
                    axis, size = "channel", min(group_size, head_dim)
                else:
                    clips = list(clip_grid) if fit_clip else [default_clip]
                    axis, size = "token", group_size
                for clip in clips:
                    clip = None if clip is not None and clip >= 1.0 else clip
                    cand = Candidate(_candidate_name(layout, centered), GroupLayout(axis, size, clip), rot, mean,
                                     evals)
                    err = float("nan") if probe is None else probe.error(kind, cand)
                    errors[f"{kind}:{cand.name}@{clip}"] = err
                    if best is None or err < best[1]:
                        best = (cand, err)
        chosen[kind] = best
    return LayerChoice(chosen["key"][0], chosen["value"][0], chosen["key"][1], chosen["value"][1], errors)


def fit_layers(data: CalibrationData, *, layouts=LAYOUTS, centering=(False, True), fit_clip: bool = True,
               clip_grid=DEFAULT_CLIP_GRID, sink_tokens: int = 64, recent_tokens: int = 256, group_size: int = 128,
               scale_dtype: torch.dtype = torch.float16, progress: bool = True) -> list[LayerChoice]:
    from tqdm.auto import tqdm

    choices = []
    for idx in tqdm(range(data.num_layers), desc="fitting layouts and clips", unit="layer", disable=not progress):
        held = [w[idx] for w in data.held_out]
        probe = LayerErrorProbe(held, sink_tokens, recent_tokens, scale_dtype) if held else None
        choices.append(fit_layer(data.stats[idx], probe, data.head_dim, layouts=layouts, centering=centering,
                                 fit_clip=fit_clip, clip_grid=clip_grid, group_size=group_size))
    return choices


# ---------------------------------------------------------------------------------------------- result
def build_cache(data: CalibrationData, choices: Sequence[LayerChoice], config=None, *, sink_tokens: int = 64,
                recent_tokens: int = 256, group_size: int = 128, scale_dtype: torch.dtype = torch.float16,
                info: dict | None = None):
    """An :class:`OscarCache` storing every layer as its :class:`LayerChoice` says."""
    from .cache import OscarCache

    cache = OscarCache(
        config,
        k_rotations=[c.key.rotation for c in choices], v_rotations=[c.value.rotation for c in choices],
        k_clip=[c.key.layout.clip for c in choices], v_clip=[c.value.layout.clip for c in choices],
        key_means=[c.key.mean for c in choices], value_means=[c.value.mean for c in choices],
        layer_layouts=[(c.key.layout, c.value.layout) for c in choices],
        sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size, scale_dtype=scale_dtype)
    cache.k_eigenvalues = [c.key.eigenvalues for c in choices]
    cache.v_eigenvalues = [c.value.eigenvalues for c in choices]
    cache.layout_names = [f"key={c.key.name} value={c.value.name}" for c in choices]
    cache.calibration_info = dict(info or {})
    return cache


def calibration_info(data: CalibrationData, choices: Sequence[LayerChoice], config, data_description: str,
                     model_id: str | None = None, model_revision: str | None = None, *, layouts=LAYOUTS,
                     centering=(False, True), fit_clip: bool = True, clip_grid=DEFAULT_CLIP_GRID) -> dict:
    """The deterministic description stored in the artifact (no timings: same inputs, same bytes)."""
    return {
        "base_model": model_id or getattr(config, "name_or_path", None) or None,
        "base_model_revision": model_revision or getattr(config, "_commit_hash", None),
        "num_layers": data.num_layers, "num_key_value_heads": data.kv_heads, "head_dim": data.head_dim,
        "data": data_description,
        "num_tokens": data.info["num_tokens"], "statistics_tokens": data.info["statistics_tokens"],
        "held_out_tokens": data.info["held_out_tokens"], "window": data.info["window"],
        "token_sha256": data.info["token_sha256"],
        "method": "two-pass streaming qqt/sst metrics, per-layer layout and clip by held-back attention error",
        "candidates": {"layouts": list(layouts), "centering": list(centering), "fit_clip": fit_clip,
                       "clip_grid": [float(r) for r in clip_grid] if fit_clip else None},
        "attention_error": {"key": [c.key_error for c in choices], "value": [c.value_error for c in choices]},
    }


def calibrate(model, tokenizer, texts: Sequence[str], num_tokens: int = 30000, window: int = 2048, *,
              fit_clip: bool = True, layouts: Sequence[str] = LAYOUTS, centering: Sequence[bool] = (False, True),
              clip_grid: Sequence[float] = DEFAULT_CLIP_GRID, fit_windows: int = 1, fit_queries: int = 256,
              sink_tokens: int = 64, recent_tokens: int = 256, group_size: int = 128,
              scale_dtype: torch.dtype = torch.float16, data_description: str | None = None,
              model_id: str | None = None, model_revision: str | None = None, value_pass: str = "spill",
              spill_dir: str | None = None, progress: bool = True, verbose: bool = True):
    """Calibrate OSCAR for ``model`` on ``texts`` and return a ready :class:`~hf_kvint2.OscarCache`.

    ``num_tokens`` tokens are read (the last ``fit_windows`` windows of ``window`` tokens held back for fitting).
    ``value_pass``: ``"spill"`` keeps one window of keys/values per window in a temporary folder (``spill_dir``)
    between the two passes, ``"recompute"`` runs the model twice (see the module docstring).
    ``layouts`` / ``centering`` are the per-layer candidates (SPEC 3.7); ``fit_clip=False`` keeps the reference
    clips 0.96 / 0.92 instead of searching ``clip_grid``. The result carries ``k_eigenvalues``,
    ``v_eigenvalues``, ``layout_names``, ``calibration_info`` (deterministic: goes into the artifact) and
    ``calibration_report`` (time, peak memory, errors: printed, not saved, so that the artifact is bit-identical
    for the same inputs).
    """
    layouts, centering = tuple(layouts), tuple(centering)
    if not layouts or any(lay not in LAYOUTS for lay in layouts):
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {layouts}.")
    if not centering or any(not isinstance(c, bool) for c in centering):
        raise ValueError(f"centering must be a non-empty tuple of booleans, got {centering}.")
    if any(not (0.0 < r <= 1.0) for r in clip_grid):
        raise ValueError(f"clip_grid ratios must lie in (0, 1], got {tuple(clip_grid)}.")
    if num_tokens <= 0 or window <= 0 or fit_windows < 0:
        raise ValueError("num_tokens and window must be positive and fit_windows non-negative.")
    choosing = fit_clip or len(layouts) * len(centering) > 1
    if choosing and fit_windows == 0:
        raise ValueError("Fitting clips or choosing among layouts needs fit_windows >= 1 held-back window.")
    start = time.perf_counter()
    data = collect_statistics(model, tokenizer, texts, num_tokens=num_tokens, window=window,
                              fit_windows=fit_windows if choosing else 0, fit_queries=fit_queries,
                              sink_tokens=sink_tokens, recent_tokens=recent_tokens, value_pass=value_pass,
                              spill_dir=spill_dir, progress=progress)
    fit_start = time.perf_counter()
    choices = fit_layers(data, layouts=layouts, centering=centering, fit_clip=fit_clip, clip_grid=clip_grid,
                         sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size,
                         scale_dtype=scale_dtype, progress=progress)
    seconds = time.perf_counter() - start
    info = calibration_info(data, choices, model.config, data_description or
                            f"{len(texts) if not isinstance(texts, str) else 1} text(s)", model_id, model_revision,
                            layouts=layouts, centering=centering, fit_clip=fit_clip, clip_grid=clip_grid)
    cache = build_cache(data, choices, model.config, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                        group_size=group_size, scale_dtype=scale_dtype, info=info)
    device = next(model.parameters()).device
    cache.calibration_report = {
        "seconds": seconds, "seconds_capture": data.info["seconds_capture"],
        "seconds_fit": time.perf_counter() - fit_start, "peak_memory_bytes": _peak_memory_bytes(device),
        "choices": choices, "data": data,
    }
    if verbose and is_main_process():
        print(calibration_summary(cache))
    return cache


def _clip_str(clip) -> str:
    return "-" if clip is None else f"{clip:.2f}"


def calibration_summary(cache, artifact_path: str | None = None) -> str:
    """A printable table: tokens, time, peak memory, and per layer the chosen layouts, clips and errors."""
    info, report = cache.calibration_info, getattr(cache, "calibration_report", {}) or {}
    lines = [
        f"OSCAR calibration of {info.get('base_model')} on {info.get('data')}",
        (f"  tokens: {info.get('num_tokens')} ({info.get('statistics_tokens')} for statistics, "
         f"{info.get('held_out_tokens')} held back for fitting), window {info.get('window')}"),
    ]
    if report:
        lines.append(f"  time: {report['seconds']:.1f} s (capture {report['seconds_capture']:.1f} s, fitting "
                     f"{report['seconds_fit']:.1f} s); peak memory: {report['peak_memory_bytes'] / 2**20:.0f} MiB")
    lines.append(f"  {'layer':>5}  {'key layout':<16}{'k clip':>7}{'k err':>10}  {'value layout':<16}{'v clip':>7}"
                 f"{'v err':>10}")
    errors = info.get("attention_error", {})
    for i, pair in enumerate(cache.layer_layouts):
        kname, vname = cache.layout_names[i].removeprefix("key=").split(" value=")
        ke, ve = errors.get("key", [None] * (i + 1))[i], errors.get("value", [None] * (i + 1))[i]
        fmt = lambda e: "-" if e is None or math.isnan(e) else f"{e:.2e}"
        lines.append(f"  {i:>5}  {kname:<16}{_clip_str(pair[0].clip):>7}{fmt(ke):>10}  {vname:<16}"
                     f"{_clip_str(pair[1].clip):>7}{fmt(ve):>10}")
    if artifact_path is not None:
        lines.append(f"  artifact written to: {artifact_path}")
    return "\n".join(lines)
