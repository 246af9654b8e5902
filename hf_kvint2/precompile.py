"""Compile the CPU kernels ahead of their first use: ``python -m hf_kvint2.precompile``.

The Numba kernels (:mod:`hf_kvint2.cpu_kernels`) compile on first use, once per head_dim and scale storage, and are
cached on disk (``NUMBA_CACHE_DIR``, else ``__pycache__`` next to them); later processes load them. This command
compiles, for each head_dim of the artifacts shipped with hf_kvint2 (``hf_kvint2.hub.EMBEDDED_ARTIFACTS``), what
those artifacts and the default ``OscarCache`` / ``OscarScaledCache`` use there, and runs every one of their layer
layouts once through the write path, the body partial and the whole-layer step (so each layout's code has run:
nothing is left to compile at a model's first step). Useful where the first step must not wait, e.g. when building
a container image.
"""

from __future__ import annotations

import argparse

# torch and the caches are imported after the arguments are parsed, so that --help prints at once and compiles nothing.


def shipped_recipes(artifacts=None) -> dict[tuple[int, object], dict]:
    """What the shipped artifacts and the default caches run: ``{(head_dim, scale dtype): {(key layout, value
    layout): (recipe, where)}}``, the layouts with their group sizes for that head_dim. An artifact's layers are its
    quantized layers' recipes (layers it keeps in full precision have none); the default caches are taken at each
    head_dim of an artifact (the bundled models')."""
    from dataclasses import replace

    from .cache import OscarCache
    from .hub import EMBEDDED_ARTIFACTS
    from .settings import OscarCalibration, OscarScaledSettings, OscarSettings, oscar_layer_recipe

    found: dict[tuple[int, object], dict] = {}

    def add(d: int, recipe, where: str) -> None:
        layouts = tuple(replace(layout, group_size=layout.group_for(d)) for layout in (recipe.key, recipe.value))
        found.setdefault((d, recipe.scale_dtype), {}).setdefault(layouts, (recipe, where))

    for artifact_id in EMBEDDED_ARTIFACTS if artifacts is None else artifacts:
        cache = OscarCache.from_pretrained(artifact_id)
        d, layers = cache.artifact_info["head_dim"], cache.artifact_info["num_layers"]
        layouts = cache.calibration.layer_layouts or (None,) * layers
        for idx in range(layers):
            if layouts[idx] is not None:
                add(d, oscar_layer_recipe(cache.settings, cache.calibration, idx), f"{artifact_id} layer {idx}")
        add(d, oscar_layer_recipe(OscarSettings(), OscarCalibration(), 0), "OscarCache")
        add(d, OscarScaledSettings().recipe(), "OscarScaledCache")
    return found


def run_layout(d: int, recipe, heads: int = 2) -> None:
    """One layout through the compiled code a dynamic layer runs: its streams' appends (the write path's
    quantizer for per-token groups), the body partial and the whole-layer step."""
    import torch

    from . import cpu_kernels
    from .stream import QuantizedStream, StreamCodec
    from .transforms import block_hadamard_matrix

    gen = torch.Generator().manual_seed(0)
    bodies = []
    for layout, rotation, mean in ((recipe.key, recipe.key_rotation, recipe.key_mean),
                                   (recipe.value, recipe.value_rotation, recipe.value_mean)):
        group = layout.group_for(d)
        rotation = block_hadamard_matrix(d) if rotation is None else rotation
        mean = None if mean is None else torch.zeros(heads, d)
        stream = QuantizedStream(StreamCodec(layout, group, rotation, mean, recipe.scale_dtype))
        for _ in range(2):  # a first append, then one into the buffers (a decode step's demotion)
            stream.append(torch.randn(1, heads, max(group, 4), d, generator=gen))
        bodies.append(stream.read())
    q = torch.randn(1, heads, 1, d, generator=gen)
    cpu_kernels.body_attention(q, *bodies, scaling=d ** -0.5)
    window = (torch.randn(1, heads, 2, d, generator=gen), torch.randn(1, heads, 2, d, generator=gen))
    cpu_kernels.layer_step_attention(q, window, *bodies, window, scaling=d ** -0.5)


def precompile(artifacts=None) -> list[str]:
    """Compile (or load from the disk cache) and run everything :func:`shipped_recipes` lists (for ``artifacts``,
    default all shipped ones), and the update's NaN/Inf check for every K/V dtype. Returns a line per head_dim and
    scale dtype."""
    import torch

    from . import cpu_kernels
    from .cpu_kernels.jit import require_numba

    require_numba()
    done = []
    for (d, scale_dtype), recipes in sorted(shipped_recipes(artifacts).items(), key=lambda item: (item[0][0], str(item[0][1]))):
        sources = sorted({where.split(" layer ")[0] for _, where in recipes.values()})
        for recipe, _ in recipes.values():
            run_layout(d, recipe)
        done.append(f"head_dim {d}, {str(scale_dtype).removeprefix('torch.')} scales: {len(recipes)} layouts "
                    f"({', '.join(sources)})")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # as the attention passes K/V: strided or not, each
        strided = torch.zeros(1, 2, 3, 4, dtype=dtype).transpose(1, 2)  # (size-1 dims would leave it contiguous)
        for k in (strided, strided.contiguous()):
            for v in (strided, strided.contiguous()):
                cpu_kernels.all_finite(k, v)
    return done


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m hf_kvint2.precompile",
        description="Compile the CPU kernels that the artifacts shipped with hf_kvint2 and the default OscarCache / "
                    "OscarScaledCache use (once per head_dim), and run each of their layouts once. Later processes "
                    "load them from Numba's disk cache (NUMBA_CACHE_DIR, else __pycache__ inside the package).").parse_args(argv)
    for line in precompile():
        print(f"compiled the CPU kernels for {line}")


if __name__ == "__main__":
    main()
