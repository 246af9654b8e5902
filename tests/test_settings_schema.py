"""An artifact's settings are type-checked at load, against one schema, with errors naming the
file, the key and the expected type.

One validation place (hf_kvint2.settings), so that no loosely typed value slips through (a string "false" must not
turn token scaling on, nor ``true`` make a group of 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_kvint2 import GroupLayout, OscarCache, OscarScaledCache
from hf_kvint2.hub import ArtifactError
from hf_kvint2.settings import oscar_scaled_recipe


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


# Per-layer layout fields and calibration entries: the same checks at construction and at load, naming the field,
# the value and the expected type. They used to run: a string "false" turned token scaling on, True was a group of
# 1, a string clip failed with a TypeError at the first update, a nested list for a rotation with an AttributeError,
# and hadamard_block=3 was later reported as "head_dim=16 is not a power of two".
@pytest.mark.parametrize("make,message", [
    (lambda: GroupLayout(group_size=True), r"GroupLayout: group_size must be a positive int, got True \(bool\)"),
    (lambda: GroupLayout(clip="0.9"), r"GroupLayout: clip must be a ratio in \(0, 1\] or None, got '0.9' \(str\)"),
    (lambda: GroupLayout(token_scaling="false"),
     r"GroupLayout: token_scaling must be a bool \(True or False\), got 'false' \(str\)"),
    (lambda: GroupLayout("channel", range_clip="0.8"), r"GroupLayout: range_clip must be a fraction .* got '0.8'"),
    (lambda: OscarCache(k_rotations=[[[1.0, 0.0], [0.0, 1.0]]]),
     r"k_rotations\[0\] must be a \[head_dim, head_dim\] tensor or None, got list"),
    (lambda: OscarCache(key_means=[None, torch.zeros(16)]),
     r"key_means\[1\] must be a \[kv_heads, head_dim\] tensor or None, got Tensor of shape \(16,\)"),
    (lambda: OscarCache(layout_names=[3]), r"layout_names\[0\] must be a string or None, got int"),
    (lambda: OscarScaledCache(hadamard_block=3),
     r"OscarScaledSettings: hadamard_block must be a power of two or None, got 3 \(int\)"),
    (lambda: oscar_scaled_recipe(hadamard_block=12), "hadamard_block must be a power of two .* got 12"),
], ids=["group-bool", "clip-str", "token-scaling-str", "range-clip-str", "nested-list-rotation", "mean-1d",
        "layout-name-int", "hadamard-block-3", "recipe-hadamard-block-12"])
def test_layout_fields_and_calibration_entries_are_type_checked_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _saved_with_layouts(tmp_path):
    g = torch.Generator().manual_seed(0)
    rot = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))[0].float()
    pair = (GroupLayout("token", 16, 0.95), GroupLayout("token", 16, 0.9))
    cache = OscarCache(k_rotations=[rot, rot], v_rotations=[rot, rot], layer_layouts=[pair, pair], sink_tokens=2,
                       recent_tokens=4)
    cache.calibration_info = {"num_layers": 2, "head_dim": 16}
    return cache.save_pretrained(tmp_path / "artifact")


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["layers"][0]["key_layout"].update(token_scaling="false"),
     r"layer 0, config\.json key layers\[0\]\.key_layout: .* token_scaling must be a bool .* got 'false' \(str\)"),
    (lambda c: c["layers"][1]["value_layout"].update(clip="0.9"),
     r"config\.json key layers\[1\]\.value_layout: .* clip must be a ratio in \(0, 1\] or None, got '0.9' \(str\)"),
    (lambda c: c["layers"][0]["value_layout"].update(axis=["token"]),
     r"layers\[0\]\.value_layout: .* axis must be one of \('token', 'channel'\), got \['token'\] \(list\)"),
    (lambda c: c["layers"][1]["key_layout"].update(token_scaling=1), r"token_scaling must be a bool .* got 1 \(int\)"),
], ids=["token-scaling-str", "clip-str", "axis-list", "token-scaling-int"])
def test_layout_fields_are_type_checked_at_load(tmp_path, edit, message):
    folder = _saved_with_layouts(tmp_path)
    _edit(folder, edit)
    with pytest.raises(ArtifactError, match=message):
        OscarCache.from_pretrained(folder)


def test_a_hadamard_block_that_is_not_a_power_of_two_is_refused_at_load(tmp_path):
    folder = _saved(tmp_path, OscarScaledCache())
    _edit(folder, lambda c: c["settings"].update(hadamard_block=3))
    with pytest.raises(ArtifactError, match=r"config\.json: OscarScaledSettings: hadamard_block must be a power of "
                                            r"two or None, got 3"):
        OscarScaledCache.from_pretrained(folder)
