"""Calibration artifacts (SPEC 6): the on-disk format, save / load / push through ``huggingface_hub``, validation
against the model, the reference OSCAR RotationZoo import, and the registry of artifacts shipped in the package.

Work in progress: the constants below are the agreed paths.
"""

from __future__ import annotations

from pathlib import Path

FORMAT_VERSION = 1
OSCAR_FORMAT = "hf_kvint2.oscar"
OSCAR_SCALED_FORMAT = "hf_kvint2.oscar_scaled"
CONFIG_NAME = "config.json"
TENSORS_NAME = "model.safetensors"
CARD_NAME = "README.md"

# Artifacts shipped inside the package (package data): ``OscarCache.from_pretrained(<id>)`` loads them from here
# without touching the network. Each folder holds config.json + model.safetensors + README.md written by
# ``save_pretrained``.
EMBEDDED_ARTIFACTS_DIR = Path(__file__).parent / "artifacts"
SMOLLM2_ARTIFACT_ID = "hf-kvint2/SmolLM2-135M-Instruct-oscar"
# The calibration of SmolLM2-135M-Instruct on Pride and Prejudice: write it with
# ``cache.save_pretrained(SMOLLM2_ARTIFACT_DIR)``.
SMOLLM2_ARTIFACT_DIR = EMBEDDED_ARTIFACTS_DIR / "SmolLM2-135M-Instruct-oscar"
EMBEDDED_ARTIFACTS = {SMOLLM2_ARTIFACT_ID: SMOLLM2_ARTIFACT_DIR}
