"""An artifact's settings are type-checked at load, against one schema, with errors naming the
file, the key and the expected type.

One validation place (hf_kvint2.settings), so that no loosely typed value slips through (a string "false" must not
turn token scaling on, nor ``true`` make a group of 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvint2 import OscarCache, OscarScaledCache
from hf_kvint2.hub import ArtifactError


def _saved(tmp_path, cache):
    if isinstance(cache, OscarCache):
        g = torch.Generator().manual_seed(0)
        rot = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))[0].float()
        cache = OscarCache(k_rotations=[rot, rot], v_rotations=[rot, rot], sink_tokens=2, recent_tokens=4)
        cache.calibration_info = {"num_layers": 2, "head_dim": 16}
    return cache.save_pretrained(tmp_path / "artifact")


def _edit(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("make,edit,key", [
    (OscarScaledCache, lambda c: c["settings"].update(token_scaling="false"), "token_scaling"),
    (OscarScaledCache, lambda c: c["settings"].update(group_size=True), "group_size"),
    (OscarScaledCache, lambda c: c["settings"].update(recent_tokens=12.5), "recent_tokens"),
    (OscarScaledCache, lambda c: c["settings"].update(hadamard_block="16"), "hadamard_block"),
    (OscarScaledCache, lambda c: c.update(format=["hf_kvint2.oscar_scaled"]), "format"),
    (OscarScaledCache, lambda c: c.update(quality="abc"), "quality"),
    (OscarScaledCache, lambda c: c.update(calibration=[1, 2]), "calibration"),
    (OscarCache, lambda c: c["settings"].update(k_clip=[[0.9], [0.9]]), "k_clip"),
    (OscarCache, lambda c: c["layers"][0].update(key_rotation="yes"), "key_rotation"),
    (OscarCache, lambda c: c["layers"][0].update(layout=[1]), "layout"),
    (OscarCache, lambda c: c.update(base_model=3), "base_model"),
])
def test_wrongly_typed_settings_are_refused_at_load_naming_file_key_and_type(tmp_path, make, edit, key):
    folder = _saved(tmp_path, make())
    _edit(folder, edit)
    with pytest.raises(ArtifactError, match=rf"config\.json.*{key}.*(expected|must be)"):
        make.from_pretrained(folder)


def test_settings_errors_come_at_load_not_at_first_update_or_save(tmp_path):
    folder = _saved(tmp_path, OscarScaledCache())
    _edit(folder, lambda c: c["settings"].update(scale_dtype="float16", key_group_size=[32]))
    with pytest.raises(ArtifactError, match="key_group_size"):
        OscarScaledCache.from_pretrained(folder)
