"""Tensor parallelism and multi-device helpers: which KV heads this rank holds, and the few collectives the caches
need.

Under ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` (or the older
``tp_plan="auto"``) transformers shards ``k_proj``/``v_proj`` column-wise: rank ``r`` of a tensor-parallel group of
size ``n`` computes the contiguous KV heads ``[r * H / n, (r + 1) * H / n)`` and hands only those to the cache.
Everything the caches do is per head except OScaR's omni-token key norm (over all KV heads of a layer), which
becomes an all-reduce of squared norms, and the global accounting views.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .model_config import model_shape


def _distributed_tp_size(config) -> int:
    """The tensor-parallel degree transformers recorded on the model config (1 if it was not sharded)."""
    for cfg in (config, config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None):
        dc = getattr(cfg, "distributed_config", None)
        if dc is None:
            continue
        size = dc.get("tp_size") if isinstance(dc, dict) else getattr(dc, "tp_size", None)
        if size:
            return int(size)
    return 1


def global_kv_heads(config) -> int:
    return int(model_shape(config).num_key_value_heads)


def tp_group(model) -> dist.ProcessGroup | None:
    """The tensor-parallel process group of a model loaded with a ``tp_plan`` (None if it is not sharded)."""
    if not (getattr(model, "tp_size", None) or 1) > 1:
        return None
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        return manager.get_mesh("tp").get_group()
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None:
        return mesh["tp"].get_group() if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh.get_group()
    raise ValueError("The model reports tensor parallelism but carries no device mesh; pass its tensor-parallel "
                     "process group to the cache explicitly (tp_group=...).")


@dataclass(frozen=True)
class TensorParallelShard:
    """This rank's place in the tensor-parallel group that shares each layer's KV heads."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    global_kv_heads: int

    @property
    def local_kv_heads(self) -> int:
        return self.global_kv_heads // self.world_size

    def head_slice(self, heads: int, what: str) -> slice:
        """The slice of a per-head tensor with ``heads`` (global) heads that this rank holds."""
        if heads % self.world_size:
            raise ValueError(
                f"{what} has {heads} KV heads, which do not divide across the {self.world_size} tensor-parallel "
                f"ranks; run with a tensor-parallel size that divides {heads}.")
        if heads != self.global_kv_heads:
            raise ValueError(f"{what} has {heads} KV heads but the model has {self.global_kv_heads}: the calibration "
                             "does not match this model.")
        n = heads // self.world_size
        return slice(self.rank * n, (self.rank + 1) * n)

    def check_local_heads(self, heads: int, where: str) -> None:
        if heads * self.world_size != self.global_kv_heads:
            raise ValueError(
                f"{where}: this rank holds {heads} KV heads, but {self.global_kv_heads} KV heads over "
                f"{self.world_size} tensor-parallel ranks means {self.global_kv_heads / self.world_size:g} per rank. "
                "The cache's tensor-parallel group does not match the model's sharding: build the cache with "
                "config=model.config and tp_group=hf_kvint2.distributed.tp_group(model).")

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the group (exact up to float addition order)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's per-head tensor along dim 0, in rank order: the global heads."""
        device = tensor.device
        if dist.get_backend(self.group) == "nccl" and device.type != "cuda":  # NCCL moves device tensors only
            tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts).to(device)


def resolve_shard(config, tp_group: dist.ProcessGroup | None = None) -> TensorParallelShard | None:
    """This rank's :class:`TensorParallelShard` for a model config, or None for an unsharded model.

    The tensor-parallel degree comes from ``config.distributed_config`` (set by transformers when it shards the
    model) or from an explicit ``tp_group``. Without a group, the default group is used when its size equals the
    tensor-parallel degree (pure tensor parallelism); combined pipeline/data parallelism needs ``tp_group``.
    """
    tp_size = _distributed_tp_size(config) if config is not None else 1
    if tp_group is None and tp_size == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"The model config says tensor-parallel size {tp_size} but torch.distributed is not "
                         "initialized; launch with torchrun (or init_process_group) before building the cache.")
    if tp_group is None:
        if dist.get_world_size() != tp_size:
            raise ValueError(
                f"The model is tensor-parallel over {tp_size} ranks but the default process group has "
                f"{dist.get_world_size()}: pass tp_group=hf_kvint2.distributed.tp_group(model) to the cache.")
        tp_group = dist.group.WORLD
    world = dist.get_world_size(tp_group)
    if tp_size > 1 and world != tp_size:
        raise ValueError(f"tp_group has {world} ranks but the model was sharded over {tp_size}; pass the model's "
                         "own tensor-parallel group (hf_kvint2.distributed.tp_group(model)).")
    if config is None:
        raise ValueError("A tensor-parallel cache needs the model config to know the global KV-head count: "
                         "build it with config=model.config.")
    heads = global_kv_heads(config)
    if heads % world:
        raise ValueError(f"The model has {heads} KV heads, which do not divide across {world} tensor-parallel "
                         f"ranks; use a tensor-parallel size that divides {heads}.")
    return TensorParallelShard(tp_group, dist.get_rank(tp_group), world, heads)


def is_main_process() -> bool:
    """True unless this is a torch.distributed rank other than 0 (only rank 0 writes or uploads artifacts)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


_warned_undetected = False


def warn_if_undetectable(config) -> None:
    """A cache built without a config cannot tell a tensor-parallel shard from a whole model: say so once."""
    global _warned_undetected
    if config is None and not _warned_undetected and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1:
        _warned_undetected = True
        warnings.warn("torch.distributed is initialized but this cache was built without config=model.config, so "
                      "it treats each rank's KV heads as the whole layer. Under tensor parallelism pass "
                      "config=model.config (and tp_group= for mixed parallelism) to keep results identical to a "
                      "single process.", stacklevel=3)
