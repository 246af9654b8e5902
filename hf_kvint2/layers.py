"""One cache layer: full-precision sink, INT2 body, full-precision recent window.

Token flow: the first ``sink_tokens`` tokens stay in the sink; later tokens enter the recent window; when the
window holds more than ``recent_tokens`` tokens, the oldest leave it (in multiples of the recipe's demotion
block) and are centred, rotated, optionally token-scaled and clipped, quantized to INT2 and appended to the
body. Quantized tokens are never re-quantized. The windows keep the model's own K/V (original space, exact);
the body keeps the transformed data.

In every forward, the tokens of the current chunk are attended at full precision (what a fused prefill with
SDPA does); earlier tokens are attended as stored.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import CacheLayerMixin

from . import cpu_kernels
from .distributed import TensorParallelShard
from .key_basis import CHANNEL_ERROR_TOKENS, settled_key_codec
from .padding import check_position_ids, left_padding, position_ids_of_update
from .quant import to_model_dtype, tracing
from .recipes import LayerRecipe
from .steps import LayerStep
from .stream import QuantizedStream, StreamCodec
from .transforms import block_hadamard_matrix, check_orthogonal, is_power_of_two, largest_pow2_divisor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tokens quantized per step when many leave the recent window at once (a long prefill): the float32 temporaries of
# the transform scale with this, not with the prompt. A multiple of every demotion block in use (powers of two).
QUANTIZE_BLOCK_TOKENS = 4096
_CPU_FINITE_CHECK = cpu_kernels.available()  # the compiled NaN/Inf check serves CPU K/V of every supported dtype
RESET_FIX = "Call cache.reset() (or use a new cache) for a different model, batch or dtype."
# Whether autocast is on for any device: one C call (asking for the K/V's device would cost a device object per update)
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def one_dtype(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V in one dtype, the wider of two supported ones (``torch.promote_types``). Under CPU autocast the keys
    leave the rotary embedding in float32 and the values the projection in bfloat16; ``DynamicCache`` stores each as
    it comes, an Oscar layer keeps one dtype for both: the body is the same INT2 codes, and only the full-precision
    windows' values take the wider dtype. Other pairs are left to :func:`validate_kv`'s error."""
    if k.dtype != v.dtype and k.dtype in SUPPORTED_DTYPES and v.dtype in SUPPORTED_DTYPES:
        common = torch.promote_types(k.dtype, v.dtype)
        return k.to(common), v.to(common)
    return k, v


def write_path_inputs(update):
    """Wraps a layer's ``update``: the write path runs without autocast (which would run its matmuls in 16 bits and
    change what is stored), on K and V in one dtype (:func:`one_dtype`; CPU autocast gives float32 keys and
    bfloat16 values)."""
    @functools.wraps(update)
    def wrapped(self, key_states, value_states, *args, **kwargs):
        if any_autocast() and torch.is_autocast_enabled(key_states.device.type):
            with torch.autocast(key_states.device.type, enabled=False):
                return wrapped(self, key_states, value_states, *args, **kwargs)
        if key_states.dtype != value_states.dtype:
            key_states, value_states = one_dtype(key_states, value_states)
        return update(self, key_states, value_states, *args, **kwargs)
    return wrapped


def validate_kv(layer, k: torch.Tensor, v: torch.Tensor, fix: str, update_args: tuple = ((), {})) -> None:
    """Checks of new K/V shared by the dynamic and static layers: rank, equal shapes, dtype, head_dim; once the
    layer is initialized, the batch, heads, head_dim and dtype it holds (``fix`` tells the user what to do);
    no NaN/Inf unless the recipe turns that off (skipped while tracing: it needs the data). ``update_args``: the
    other arguments of ``update`` (args, kwargs): NaN K/V from NaN position ids are blamed on those."""
    if layer.is_initialized and _same_kind_as_layer(layer, k, v):  # a decode step: the checks below all pass
        _refuse_nonfinite(layer, k, v, update_args)
        return
    where = layer._name
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{where}: expected key/value states of rank 4 [batch, kv_heads, tokens, head_dim], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}.")
    if k.shape != v.shape:
        raise ValueError(f"{where}: key states {tuple(k.shape)} and value states {tuple(v.shape)} differ in shape.")
    if k.dtype not in SUPPORTED_DTYPES or v.dtype != k.dtype:
        raise ValueError(f"{where}: unsupported K/V dtype {k.dtype}/{v.dtype}; use one of {SUPPORTED_DTYPES}.")
    if k.device.type == "meta" or v.device.type == "meta":
        raise ValueError(f"{where}: key/value states are meta tensors (shapes without data), which cannot be "
                         "quantized. Load the model's weights onto a real device before running it with this cache.")
    b, h, _, d = k.shape
    if 0 in (b, h, d):
        raise ValueError(f"{where}: key/value states of shape {tuple(k.shape)} have an empty batch, kv_heads or "
                         "head_dim; a cache needs at least one sequence, one head and one channel.")
    if d % 4:
        raise ValueError(f"{where}: head_dim={d} is not supported: INT2 packing stores four channels per byte, so "
                         "head_dim must be a multiple of 4. Use transformers' DynamicCache for this model.")
    if layer.is_initialized:
        if (b, h, d) != (layer.batch_size, layer.num_heads, layer.head_dim):
            raise ValueError(f"{where}: got K/V with batch={b}, kv_heads={h}, head_dim={d} but the cache holds "
                             f"batch={layer.batch_size}, kv_heads={layer.num_heads}, head_dim={layer.head_dim}. {fix}")
        if k.dtype != layer.dtype:
            raise ValueError(f"{where}: K/V dtype changed from {layer.dtype} to {k.dtype}. {fix}")
    _refuse_nonfinite(layer, k, v, update_args)


def _refuse_nonfinite(layer, k: torch.Tensor, v: torch.Tensor, update_args: tuple) -> None:
    """The last check of :func:`validate_kv`, on K/V that passed the others: no NaN/Inf unless the recipe turns
    that off (skipped while tracing: it needs the data)."""
    if layer.recipe.check_finite and not tracing() and not all_finite_kv(k, v):
        check_position_ids(position_ids_of_update(*update_args), layer._name)  # NaN positions: NaN rotary keys
        raise ValueError(f"{layer._name}: key/value states contain NaN or Inf; refusing to quantize them "
                         "(check the model's dtype: fp16 overflow is a common cause).")


def _same_kind_as_layer(layer, k: torch.Tensor, v: torch.Tensor) -> bool:
    """K and V of one shape, with the batch, heads, head_dim and dtype the initialized layer holds, not on the meta
    device: every check of :func:`validate_kv` but the NaN/Inf one passes (few tensor accesses: each costs
    microseconds inside a model's step, where the weights have evicted the interpreter's data from the caches)."""
    shape = k.shape
    return (shape == v.shape and len(shape) == 4 and shape[0] == layer.batch_size and shape[1] == layer.num_heads
            and shape[3] == layer.head_dim and k.dtype == layer.dtype and v.dtype == layer.dtype
            and not k.is_meta and not v.is_meta)


def all_finite_kv(k: torch.Tensor, v: torch.Tensor) -> bool:
    """No NaN/Inf in k or v. On CPU one compiled pass over their bits (:func:`~hf_kvint2.cpu_kernels.all_finite`);
    elsewhere one reduction and one host sync per decode step: a NaN or Inf anywhere makes the fp32 sum
    non-finite; only then (or if finite values overflowed the sum) is every element checked. For K/V that passed
    :func:`validate_kv`'s other checks (rank 4, one supported dtype), outside tracing: what the compiled check
    serves, so only the device is asked (each tensor access costs microseconds inside a model's step)."""
    if _CPU_FINITE_CHECK and k.is_cpu and v.is_cpu:
        return cpu_kernels.all_finite(k, v)
    total = k.sum(dtype=torch.float32) + v.sum(dtype=torch.float32)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(k).all() and torch.isfinite(v).all())


def default_rotation_error(recipe: LayerRecipe, d: int, where: str) -> str:
    """Why a layer without given rotations cannot use the default Hadamard rotation, and the fix for its cache."""
    block = largest_pow2_divisor(d)
    if recipe.method == "oscar":
        fix = ("give OscarCache rotations for every layer: calibrated ones (OscarCache.calibrate or "
               "OscarCache.from_pretrained), or k_rotations=v_rotations=[hf_kvint2.transforms."
               f"block_hadamard_matrix({d}, {block})] * num_layers")
    else:
        fix = f"pass hadamard_block={block} (any power of two dividing head_dim) to the cache"
    return (f"{where}: head_dim={d} is not a power of two, so the default Hadamard rotation"
            f"{'' if recipe.hadamard_block is None else f' of block {recipe.hadamard_block}'} does not exist; {fix}.")


class OscarLayer(CacheLayerMixin):
    """A transformers cache layer storing K/V as sink + INT2 body + recent window, per a :class:`LayerRecipe`."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, recipe: LayerRecipe, layer_idx: int | None = None, shard: TensorParallelShard | None = None):
        super().__init__()
        self.recipe = recipe
        self._unsettled_recipe: LayerRecipe | None = None  # the recipe before the key layout was settled
        self.layer_idx = layer_idx
        self.fused_attention = False  # set by the "oscar" attention when it reads this layer (hf_kvint2.steps)
        self.shard = shard  # set under tensor parallelism: this rank holds shard.local_kv_heads of the layer's heads
        self._block_of: tuple = (None, 1)  # (recipe, its demotion_block): see _whole_blocks
        self._clear()

    def __repr__(self):
        r = self.recipe
        return (f"OscarLayer(idx={self.layer_idx}, key={r.key}, value={r.value}, sink={r.sink_tokens}, "
                f"recent={r.recent_tokens}, seq_len={self.seq_len})")

    # ------------------------------------------------------------------ state
    def _clear(self) -> None:
        self.is_initialized = False
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = None
        self.key_body: QuantizedStream | None = None
        self.value_body: QuantizedStream | None = None
        self.body_len = 0
        self.seq_len = 0
        self.key_basis_open = False  # uncalibrated keys: the first demotion settles their basis (hf_kvint2.key_basis)
        self.key_range_spread: float | None = None  # what settled it (key_basis: range spread or channel-error ratio)
        self.left_padding = 0  # tokens the sink holds on top of recipe.sink_tokens (hf_kvint2.padding)
        # (key buffer, value buffer, key view, value view): the recent window's buffers with room to append in place,
        # while recent_k / recent_v are those views (_append_recent); anything else that sets them leaves it unused
        self._recent_buffers: tuple | None = None

    @property
    def _name(self) -> str:
        return f"layer {self.layer_idx}" if self.layer_idx is not None else "this cache layer"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        r = self.recipe
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.shard is not None:
            self.shard.check_local_heads(h, self._name)
        streams = []
        for kind, layout, rot, mean in (("key", r.key, r.key_rotation, r.key_mean),
                                        ("value", r.value, r.value_rotation, r.value_mean)):
            if rot is None:
                if not is_power_of_two(r.hadamard_block or d):
                    raise ValueError(default_rotation_error(r, d, self._name))
                rot = block_hadamard_matrix(d, r.hadamard_block, torch.float32, self.device)
            else:
                if tuple(rot.shape) != (d, d):
                    raise ValueError(f"The {kind} rotation of {self._name} is {tuple(rot.shape)} but the model's "
                                     f"head_dim is {d}: the calibration artifact does not match this model.")
                check_orthogonal(rot, f"The {kind} rotation of {self._name}")
                rot = rot.to(device=self.device, dtype=torch.float32)
            if mean is not None:
                if self.shard is not None and mean.dim() == 2:  # calibrated over all heads: keep this rank's
                    mean = mean[self.shard.head_slice(mean.shape[0], f"The {kind} mean of {self._name}")]
                if tuple(mean.shape) != (h, d):
                    raise ValueError(f"The {kind} mean of {self._name} is {tuple(mean.shape)}, expected "
                                     f"(kv_heads={h}, head_dim={d}): the calibration does not match this model.")
                mean = mean.to(device=self.device, dtype=torch.float32)
            group = layout.group_for(d)
            if layout.axis == "token" and d % group:
                raise ValueError(f"head_dim={d} is not a multiple of the {kind} group size {group}; "
                                 f"use a group size dividing {d}.")
            streams.append(self._new_stream(kind, StreamCodec(layout, group, rot, mean, r.scale_dtype, self.shard)))
        self.key_body, self.value_body = streams
        self.key_basis_open = r.key_rotation is None
        empty = key_states.new_empty(b, h, 0, d)
        self.sink_k, self.sink_v, self.recent_k, self.recent_v = empty, empty.clone(), empty.clone(), empty.clone()
        self.is_initialized = True

    # ------------------------------------------------------------------ update
    @write_path_inputs
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        validate_kv(self, key_states, value_states, fix=RESET_FIX, update_args=(args, kwargs))
        n_new = key_states.shape[-2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seq_len == 0:  # a first chunk: learn the batch's left padding from its position ids
            self.left_padding = left_padding(position_ids_of_update(args, kwargs), n_new, self._name)
        sink_tokens = self.recipe.sink_tokens + self.left_padding
        to_sink = min(max(sink_tokens - self.sink_k.shape[-2], 0), n_new) if self.body_len == 0 and \
            self.recent_k.shape[-2] == 0 else 0
        before = (self.sink_k, self.sink_v, self.recent_k, self.recent_v)
        if to_sink:
            self._append_sink(key_states[:, :, :to_sink], value_states[:, :, :to_sink])
        # the chunk's tokens after the sink's (no slices when there are none: every decode step)
        new_k, new_v = (key_states, value_states) if to_sink == 0 else \
            (key_states[:, :, to_sink:], value_states[:, :, to_sink:])
        try:
            if n_new > to_sink:
                self._take(new_k, new_v)
        except ValueError as err:  # e.g. values too large for fp16 scales: reject the update, keep the cache as it was
            self.sink_k, self.sink_v, self.recent_k, self.recent_v = before
            self._truncate_body(self.body_len)
            raise ValueError(f"{self._name}: {err}") from err
        self.seq_len += n_new
        # Once the "oscar" attention reads this layer, zero-storage placeholders it reads the codes through (other
        # attention implementations still get the full view from them); else the full view itself (hf_kvint2.steps).
        step = LayerStep(self, key_states, value_states)
        return step.output(like=step.tail_k)

    def _take(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Store the chunk's tokens after the sink's: those that leave the recent window (``new_k`` appended), in
        whole demotion blocks, go to the body straight from the window and the chunk; the rest become the window.
        A long chunk is never copied whole (a 32k-token prefill quantizes from views of it), and a decode step that
        demotes nothing appends in place (:meth:`_append_recent`)."""
        n_recent = self.recent_k.shape[-2]
        overflow = n_recent + new_k.shape[-2] - self.recipe.recent_tokens
        if overflow > 0 and self.key_basis_open and self.recipe.key.axis == "token" and not tracing():
            # decided on at least one group of tokens (a group's range needs them): after a short prompt the first
            # overflow is a few tokens, so the window's next ones are read too (the decision is made only once)
            count = min(max(overflow, self.key_body.codec.group), n_recent + new_k.shape[-2])
            self._settle_keys(self._leading(self.recent_k, new_k, count))  # may switch to per-channel groups
        n = self._whole_blocks(overflow)  # after the settling: it may change the demotion block
        if n <= 0:
            self._append_recent(new_k, new_v)
            return
        if self.key_basis_open and not tracing():  # settled once, by the first demotion (the eager prefill)
            if self.recipe.key.axis == "channel":  # (the decision reads at most CHANNEL_ERROR_TOKENS of them)
                self._settle_keys(self._leading(self.recent_k, new_k, min(n, CHANNEL_ERROR_TOKENS)))
            self.key_basis_open = False
        self._append_to_body(new_k, new_v, n)
        if n <= n_recent:
            self._new_recent_buffers(self.recent_k[:, :, n:], self.recent_v[:, :, n:], new_k, new_v)
        else:  # the window is the chunk's last tokens: a copy (a view would keep the whole chunk alive)
            rest = n - n_recent
            self._new_recent_buffers(self.recent_k[:, :, :0], self.recent_v[:, :, :0], new_k[:, :, rest:],
                                     new_v[:, :, rest:])

    def _append_sink(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """The sink = the sink then ``new_k``/``new_v`` (a layer whose windows live in preallocated storage, e.g. a
        serving engine's window slots, writes them there)."""
        self.sink_k = torch.cat([self.sink_k, new_k], dim=-2)
        self.sink_v = torch.cat([self.sink_v, new_v], dim=-2)

    def _new_stream(self, kind: str, codec: StreamCodec) -> QuantizedStream:
        """The store of the ``kind`` ("key" / "value") body: a growing :class:`QuantizedStream` (a layer whose body
        lives elsewhere, e.g. in a serving engine's pages, returns a store with the same interface)."""
        return QuantizedStream(codec)

    @staticmethod
    def _leading(recent: torch.Tensor, new: torch.Tensor, count: int) -> torch.Tensor:
        """The first ``count`` tokens of ``recent`` then ``new``: a view where they lie in one of them."""
        n_recent = recent.shape[-2]
        if count <= n_recent:
            return recent[:, :, :count]
        if n_recent == 0:
            return new[:, :, :count]
        return torch.cat([recent, new[:, :, :count - n_recent]], dim=-2)

    def _append_recent(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Append ``new_k``/``new_v`` to the recent window: in place where its buffers have room (a decode step
        writes one token per head instead of copying the window twice, which also kept torch's thread pool busy
        beside the attention kernel's), else into new buffers (:meth:`_new_recent_buffers`)."""
        bufs = self._recent_buffers
        n, m = self.recent_k.shape[-2], new_k.shape[-2]
        if bufs is not None and bufs[2] is self.recent_k and bufs[3] is self.recent_v and n + m <= bufs[0].shape[-2] \
                and not tracing():
            if new_k.dtype == torch.float32 and new_v.dtype == torch.float32 and bufs[0].dtype == torch.float32 and \
                    new_k.is_cpu and new_v.is_cpu and bufs[0].is_cpu and \
                    not (new_k.requires_grad or new_v.requires_grad or bufs[0].requires_grad):
                # float32 on CPU: written through numpy views (one C call each, where torch's indexing costs several
                # dispatches per write inside a model's step)
                bufs[0].numpy()[:, :, n:n + m] = new_k.numpy()
                bufs[1].numpy()[:, :, n:n + m] = new_v.numpy()
            else:
                bufs[0][:, :, n:n + m] = new_k
                bufs[1][:, :, n:n + m] = new_v
            self._use_recent_buffers(bufs[0], bufs[1], n + m)
        else:
            self._new_recent_buffers(self.recent_k, self.recent_v, new_k, new_v)

    def _new_recent_buffers(self, k: torch.Tensor, v: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """The recent window = ``k`` then ``new_k`` (``v``, ``new_v``), in new buffers with room for the tokens a
        decode step appends before the next demotion (one demotion block) when it fits the window; else (a chunk
        longer than the window, which the demotion then cuts) exactly that long, as a concatenation."""
        n = k.shape[-2] + new_k.shape[-2]
        cap = self.recipe.recent_tokens + self._demotion_block()
        if n > cap or tracing():
            self.recent_k = torch.cat([k, new_k], dim=-2)
            self.recent_v = torch.cat([v, new_v], dim=-2)
            self._recent_buffers = None
            return
        bufs = self._window_buffers(new_k, n, cap)
        for old, new, buf in ((k, new_k, bufs[0]), (v, new_v, bufs[1])):
            if old.shape[-2]:  # kept tokens of the same buffer (storage reused in place) move through a copy
                same = old.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                buf[:, :, :old.shape[-2]] = old.clone() if same else old
            buf[:, :, old.shape[-2]:n] = new
        self._use_recent_buffers(bufs[0], bufs[1], n)

    def _use_recent_buffers(self, buf_k: torch.Tensor, buf_v: torch.Tensor, n: int) -> None:
        """The recent window = the first ``n`` token slots of ``buf_k`` / ``buf_v``, buffers a decode step appends
        to in place while they have room."""
        view_k, view_v = buf_k.narrow(2, 0, n), buf_v.narrow(2, 0, n)
        self.recent_k, self.recent_v = view_k, view_v
        self._recent_buffers = (buf_k, buf_v, view_k, view_v)

    def _window_buffers(self, like: torch.Tensor, n: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of ``cap`` (at least ``n``) token slots for the recent window, zeros past what is written
        (every slot finite: :meth:`recent_slots`); a layer whose windows live in preallocated storage (a serving
        engine's window slots) returns those."""
        return tuple(like.new_zeros(like.shape[0], like.shape[1], cap, like.shape[3]) for _ in range(2))

    def recent_slots(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first ``n`` token slots of the recent window's buffers (K, V [B, H, n, D]): the window, then finite
        filler (zeros, or tokens that have left it), for a reader that masks past the window instead of copying it
        into a padded tensor; None where the window is not held in such buffers or they are shorter."""
        bufs = self._recent_buffers
        if bufs is None or bufs[2] is not self.recent_k or bufs[0].shape[-2] < n:
            return None
        return bufs[0].narrow(2, 0, n), bufs[1].narrow(2, 0, n)

    def shared_windows(self) -> tuple[tuple[torch.Tensor, ...], int] | None:
        """Where the sink and the recent window live when they share tensors with other sequences' layers (a serving
        engine's window slots): ``((sink K, sink V, recent K, recent V) [rows, H, n, D], this layer's row)``, the
        sink filling its row and the window the first tokens of its row, finite filler after them; a reader masks
        what a row does not hold instead of gathering the rows. None: this layer's windows are its own."""
        return None

    def _whole_blocks(self, overflow: int) -> int:
        """Tokens that leave a window ``overflow`` tokens over its size: whole demotion blocks of them."""
        if overflow <= 0:
            return 0
        block = self._demotion_block()
        return (overflow // block) * block

    def _demotion_block(self) -> int:
        recipe = self.recipe
        if self._block_of[0] is not recipe:  # recipe.demotion_block, once per recipe (asked twice per decode step)
            self._block_of = (recipe, recipe.demotion_block)
        return self._block_of[1]

    def _append_to_body(self, new_k: torch.Tensor, new_v: torch.Tensor, n: int) -> None:
        """Quantize the first ``n`` tokens (whole demotion blocks) of the recent window then ``new_k``/``new_v``
        into the body, ``QUANTIZE_BLOCK_TOKENS`` at a time: the float32 temporaries of the transform scale with
        that block, not with the chunk."""
        block = self.recipe.demotion_block
        step = max(block, QUANTIZE_BLOCK_TOKENS // block * block)  # whole demotion blocks: same groups, same codes
        n_recent = self.recent_k.shape[-2]
        for start in range(0, n, step):
            stop = min(start + step, n)
            for body, recent, new in ((self.key_body, self.recent_k, new_k), (self.value_body, self.recent_v, new_v)):
                if start >= n_recent:
                    body.append(new[:, :, start - n_recent:stop - n_recent])
                else:  # (a span that starts in the window is at most the window and one block)
                    body.append(self._leading(recent, new, stop)[:, :, start:])
        self.body_len += n

    def _settle_keys(self, keys: torch.Tensor) -> None:
        """Uncalibrated keys, before the first demotion: the key codec of this layer from ``keys``
        (:func:`~hf_kvint2.key_basis.settled_key_codec`). Per-token keys are decided on all the tokens leaving the
        recent window, and at least one group of the oldest tokens held, before the demotion block is known (a switch
        to per-channel groups changes it); per-channel keys on the tokens of the first demotion."""
        codec, self.key_range_spread = settled_key_codec(self.key_body.codec, keys)
        if codec is self.key_body.codec:
            return
        self.key_body = self._new_stream("key", codec)
        # per-token -> per-channel groups (the demotion block follows), or channel groups without token scaling
        if codec.layout != self.recipe.key:
            self.key_basis_open = False
            self._unsettled_recipe = self.recipe
            self.recipe = self.recipe.with_overrides(key=codec.layout, key_rotation=codec.rotation)

    @property
    def keys(self) -> torch.Tensor | None:
        """transformers' ``layer.keys``: see :meth:`_stored`."""
        return self._stored(0)

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """transformers' ``layer.values``: see :meth:`_stored`."""
        return self._stored(1)

    @values.setter
    def values(self, value) -> None:
        self._refuse_assignment("values", value)

    def _stored(self, which: int) -> torch.Tensor | None:
        """``DynamicLayer.keys`` / ``.values`` where they need no dequantization: None before the first update, every
        token [B, H, T, D] while all are in the full-precision windows (a copy); once tokens are INT2 codes a clear
        error, never None (code that reads a layer's tensors would otherwise go on without them)."""
        if not self.is_initialized:
            return None
        if self.body_len == 0:
            return torch.cat([(self.sink_k, self.sink_v)[which], (self.recent_k, self.recent_v)[which]], dim=-2)
        raise NotImplementedError(
            f"{self._name} holds {self.body_len} of its {self.seq_len} tokens as INT2 codes, not as a "
            f"{('keys', 'values')[which]} tensor: reading them as one would dequantize the layer's history. "
            "layer.dequantized_kv() returns a dequantized copy (original space, the model's dtype); code that reads "
            "or writes a layer's K/V tensors (exporters, compression libraries) needs transformers' DynamicCache.")

    def _refuse_assignment(self, name: str, value) -> None:
        if value is not None:  # (CacheLayerMixin.__init__ sets both to None)
            raise NotImplementedError(f"{self._name}: {name} cannot be assigned; the layer stores its K/V as a sink, "
                                      "INT2 codes and a recent window (update() stores new tokens).")

    def dequantized_kv(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Every token's K and V [B, H, seq_len, D] in the original space and the model's dtype (a copy; the body
        dequantized), or (None, None) before the first update."""
        if not self.is_initialized:
            return None, None
        body_k, body_v = self.dequantized_body()
        return (torch.cat([self.sink_k, body_k, self.recent_k], dim=-2),
                torch.cat([self.sink_v, body_v, self.recent_v], dim=-2))

    def dequantized_body(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The body's K/V in the original space and the model dtype, [B, H, body_len, D]."""
        if self.body_len == 0:
            return self.sink_k[:, :, :0], self.sink_v[:, :, :0]
        return (to_model_dtype(self.key_body.dequantize(), self.dtype),
                to_model_dtype(self.value_body.dequantize(), self.dtype))

    # ------------------------------------------------------------------ transformers contract
    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self._unsettled_recipe is not None:  # a key layout settled from the data is settled again
            self.recipe, self._unsettled_recipe = self._unsettled_recipe, None
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (a negative count, as ``DynamicLayer.crop``).

        Kept tokens keep their stored form; tokens that were demoted meanwhile stay quantized. A cut inside a
        token-grouped block dequantizes the block's kept tokens back into the recent window so that the body
        stays block-aligned.
        """
        if tokens_to_remove > 0:  # transformers >= 5.18 refuses the legacy target length too
            raise ValueError(f"crop({tokens_to_remove}): crop takes the number of tokens to remove, as a negative "
                             "int (crop(-n) removes the newest n); for a target length L call "
                             "cache.crop(L - cache.get_seq_length()).")
        if not self.is_initialized or tokens_to_remove == 0:
            return
        target = max(self.seq_len + tokens_to_remove, 0)
        n_sink = self.sink_k.shape[-2]
        empty = self.recent_k.new_empty(*self.recent_k.shape[:2], 0, self.recent_k.shape[-1])
        if target <= n_sink:
            self.sink_k, self.sink_v = self.sink_k[:, :, :target], self.sink_v[:, :, :target]
            self._truncate_body(0)
            self.recent_k, self.recent_v = empty, empty.clone()  # not views: they would keep the window's storage
        elif target <= n_sink + self.body_len:
            keep = target - n_sink
            block = self.recipe.group_block
            aligned = (keep // block) * block
            if aligned < keep:  # only the kept part of the cut block, cloned: no view into a dequantized copy
                k_part = self.key_body.read(self.body_len).dequantize(aligned, keep)
                v_part = self.value_body.read(self.body_len).dequantize(aligned, keep)
                self.recent_k = to_model_dtype(k_part, self.dtype).clone()
                self.recent_v = to_model_dtype(v_part, self.dtype).clone()
            else:
                self.recent_k, self.recent_v = empty, empty.clone()
            self._truncate_body(aligned)
        else:
            keep = target - n_sink - self.body_len
            self.recent_k, self.recent_v = self.recent_k[:, :, :keep], self.recent_v[:, :, :keep]
        # the window's buffers serve appends in place only while recent_k / recent_v are their views: drop them
        # otherwise (a kept view still holds its buffer, and memory_bytes counts it)
        self._recent_buffers = None
        self.seq_len = target

    def _truncate_body(self, tokens: int) -> None:
        self.key_body.truncate(tokens)
        self.value_body.truncate(tokens)
        self.body_len = tokens

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.recent_k, self.recent_v = fn(self.recent_k), fn(self.recent_v)
        self._recent_buffers = None  # (the old window's buffers: no longer its storage)
        for stream in (self.key_body, self.value_body):
            for buf in stream.buffers():
                buf.map_(fn)
            stream._last_read = None  # (a read of the old buffers: it would keep them alive until the next read)
        self.batch_size = self.sink_k.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self):
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.sink_k.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes actually held, by kind; ``elements`` counts the K and V elements they represent."""
        out = {"codes": 0, "scales": 0, "norms": 0, "full_precision": 0, "elements": 0, "allocated": 0}
        if not self.is_initialized:
            return out
        for t in (self.sink_k, self.sink_v, self.recent_k, self.recent_v):
            out["full_precision"] += t.numel() * t.element_size()
        held = [self.sink_k, self.sink_v, self.recent_k, self.recent_v, *(self._recent_buffers or ())]
        for stream in (self.key_body, self.value_body):
            out["codes"] += stream.codes.nbytes
            out["scales"] += stream.scale.nbytes + stream.lo.nbytes
            if stream.norm is not None:
                out["norms"] += stream.norm.nbytes
            held += [b.data for b in stream.buffers() if b.data is not None]
        # the storage behind every tensor held, each once: buffer capacity, and whole windows behind views (a crop
        # or a batch selection leaves views into larger storage)
        storages = {}
        for t in held:
            storage = t.untyped_storage()
            storages[storage.data_ptr(), storage.device] = storage.nbytes()
        out["allocated"] = sum(storages.values())
        out["elements"] = 2 * self.batch_size * self.num_heads * self.head_dim * self.seq_len
        return out
