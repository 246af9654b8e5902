"""Body-partial backends: one signature, registered per device, chosen in one place (:func:`select_body_partial`).

Every backend computes the body's partial attention in the rotated space (see :mod:`hf_kvint2.read_path`):
``backend(q_rot, key: QuantizedBody, value: QuantizedBody, *, scaling, key_mean_logits=None, mask=None,
**options) -> (out_rot [B, Hq, Lq, D] fp32, lse [B, Hq, Lq] fp32)``. Registered here
(:class:`~hf_kvint2.read_path.BodyBackend` entries):

* ``"torch"``: :func:`hf_kvint2.read_path.body_partial_blocked`, any device, traceable (static caches, export).
* ``"numba"``: :func:`cpu_body_partial` (the compiled kernel :func:`hf_kvint2.cpu_kernels.body_attention`, or
  for long chunks dequantized blocks and flash attention), CPU, when Numba is installed; it also offers a dynamic
  layer's whole decode step (windows, body and merge) as one call, :func:`hf_kvint2.cpu_kernels.layer_step_attention`,
  which :func:`hf_kvint2.read_path.attend_segments` calls for the steps it serves.
* ``"triton"``: :func:`hf_kvint2.kernels.body_attention`, CUDA, when Triton is installed.

A new backend: write the function, add a :class:`BodyBackend` entry to ``BODY_BACKENDS`` (device type and an
availability check), and test it against :func:`hf_kvint2.read_path.reference_body_partial`
(tests/test_attention.py runs every registered backend that is available).
"""

from __future__ import annotations

import contextlib
import os

from . import cpu_kernels, kernels
from .read_path import TORCH_BODY, BodyBackend, body_partial_dense

CPU_KERNEL_ENV = "HF_KVINT2_CPU_KERNEL"  # "torch" forces the PyTorch body on CPU (default: Numba when installed)


def cpu_body_partial(q_rot, key_body, value_body, **kwargs):
    """The ``"numba"`` backend's body partial: the compiled kernel for decode steps and short chunks (at most
    ``SPLIT_MAX_ROWS`` query rows per KV head); for a longer chunk over a stored body (chunked prefill, a serving
    engine's prompt chunks, the quality harness), dequantized blocks and flash attention
    (:func:`~hf_kvint2.read_path.body_partial_dense`), 2x faster at 128 query tokens and 9x at 2048 on SmolLM2's
    shapes, where the kernel's per-row-group decoding of every token dominates."""
    rows = q_rot.shape[1] // key_body.codes.shape[1] * q_rot.shape[2]
    if rows > cpu_kernels.SPLIT_MAX_ROWS and kwargs.get("split") is None:
        kwargs.pop("split", None)
        return body_partial_dense(q_rot, key_body, value_body, **kwargs)
    return cpu_kernels.body_attention(q_rot, key_body, value_body, **kwargs)


BODY_BACKENDS = {
    "triton": BodyBackend("triton", "cuda", kernels.triton_available, kernels.body_attention, takes_dot_dtype=True),
    "numba": BodyBackend("numba", "cpu", cpu_kernels.available, cpu_body_partial,
                         layer_step=cpu_kernels.layer_step_attention, serves_layer_step=cpu_kernels.serves_layer_step,
                         reads_pages=True),
    "torch": TORCH_BODY,
}


def select_body_partial(device, traceable: bool = False, differentiable: bool = False) -> BodyBackend:
    """The backend for queries on ``device``: Triton on CUDA, Numba on CPU (unless ``HF_KVINT2_CPU_KERNEL=torch``),
    each when installed; the PyTorch one otherwise, whenever the step is traced (``traceable``) and whenever the
    query needs gradients (``differentiable``: the kernels are not differentiable)."""
    if not (traceable or differentiable):
        if device.type == "cuda" and BODY_BACKENDS["triton"].available():
            return BODY_BACKENDS["triton"]
        if device.type == "cpu" and os.environ.get(CPU_KERNEL_ENV, "numba") != "torch" and \
                BODY_BACKENDS["numba"].available():
            return BODY_BACKENDS["numba"]
    return BODY_BACKENDS["torch"]


@contextlib.contextmanager
def cpu_body(name: str):
    """Within the block, CPU steps read the body with the ``"torch"`` or the ``"numba"`` backend (sets
    ``HF_KVINT2_CPU_KERNEL``, restored afterwards)."""
    if name not in ("torch", "numba"):
        raise ValueError(f"cpu_body: {name!r} is not a CPU body backend; use 'torch' or 'numba'.")
    before = os.environ.get(CPU_KERNEL_ENV)
    os.environ[CPU_KERNEL_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CPU_KERNEL_ENV, None)
        else:
            os.environ[CPU_KERNEL_ENV] = before


def describe() -> list[str]:
    """A line per registered backend: its device, whether it is available here, and where it is selected."""
    import torch

    selected = {select_body_partial(torch.device(t)).name: t for t in ("cuda", "cpu")}
    return [f"{b.name}: {b.device_type or 'any'} device, {'available' if b.available() else 'not available'}"
            + (f", selected for {selected[b.name]} queries" if b.name in selected else "")
            + (", also runs a dynamic layer's whole step" if b.layer_step is not None else "")
            for b in BODY_BACKENDS.values()]


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m hf_kvint2.backends",
                            description="List the body-partial backends and which one each device gets "
                                        f"({CPU_KERNEL_ENV}=torch forces the PyTorch one on CPU). To compile the "
                                        "CPU kernels ahead of their first use: python -m hf_kvint2.precompile.").parse_args()
    print("\n".join(describe()))
    print("The CPU kernels compile on first use; to compile them ahead: python -m hf_kvint2.precompile")
