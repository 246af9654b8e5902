"""Calibration artifacts: save / load / push, Hub download over real HTTP, validation, hostile files, RotationZoo.

Everything runs offline: the "Hub" is a small HTTP server on 127.0.0.1 that answers huggingface_hub's ``resolve``
routes from a local folder, and push calls are intercepted at HfApi.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import urllib.parse
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kvint2 import GroupLayout, OscarCache, OscarScaledCache, hub
from hf_kvint2.hub import ArtifactError
from hf_kvint2.transforms import spectral_rotation

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
TOKENS, CHUNK = 40, 8  # > sink + recent, so most tokens end up quantized


def make_tiny_llama(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, name="tiny/llama"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    model.config.name_or_path = name
    return model


# Tiny tensors: thread start-up dominates, and on a loaded 2-core machine extra threads make it 50x slower.
pytestmark = pytest.mark.usefixtures("module_single_thread")


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 128, (2, TOKENS), generator=torch.Generator().manual_seed(1))


def chunked_logits(model, cache, input_ids):
    """Prefill in chunks so earlier chunks are read back from the INT2 body."""
    out = []
    with torch.no_grad():
        for start in range(0, input_ids.shape[1], CHUNK):
            out.append(model(input_ids[:, start:start + CHUNK], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def random_rotation(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(HEAD_DIM, HEAD_DIM, dtype=torch.float64, generator=g)
    return spectral_rotation(a @ a.T)


def calibrated_cache(**kw):
    """What OscarCache.calibrate produces: mixed per-layer choices, eigenvalues, means, names and a description."""
    g = torch.Generator().manual_seed(2)
    (rk0, ek0), (rv0, ev0), (rv1, ev1) = random_rotation(10), random_rotation(11), random_rotation(12)
    cache = OscarCache(
        k_rotations=[rk0, None], v_rotations=[rv0, rv1], k_clip=[0.95, None], v_clip=[0.9, 0.85],
        key_means=[torch.randn(KV_HEADS, HEAD_DIM, generator=g), None],
        value_means=[torch.randn(KV_HEADS, HEAD_DIM, generator=g), torch.randn(KV_HEADS, HEAD_DIM, generator=g)],
        layer_layouts=[(GroupLayout("token", 16, 0.95), GroupLayout("token", 16, 0.9)),
                       (GroupLayout("channel", 8, None, range_clip=0.8), GroupLayout("token", 8, 0.85))],
        k_eigenvalues=[ek0, None], v_eigenvalues=[ev0, ev1], layout_names=["spectral+center", "per-channel"],
        sink_tokens=4, recent_tokens=8, **kw)
    info = {"data": "random tokens", "num_tokens": 1234, "base_model": "tiny/llama", "base_model_revision": "abc123"}
    return OscarCache(settings=cache.settings, calibration=dataclasses.replace(cache.calibration, info=info))


QUALITY = [{"cache": "DynamicCache", "perplexity": 28.79, "bits/element": 16.0},
           {"cache": "OscarCache", "perplexity": 30.1, "bits/element": 2.3}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, model, input_ids):
    """A calibrated artifact on disk and the logits of the cache it came from."""
    cache = calibrated_cache()
    folder = cache.save_pretrained(tmp_path_factory.mktemp("artifact"), quality=QUALITY)
    return folder, chunked_logits(model, cache, input_ids)


def card_metadata(path):
    return ModelCard.load(path).data.to_dict()


# ------------------------------------------------------------------------------------------------ round trips
def test_oscar_round_trip_gives_identical_logits(saved, model, input_ids):
    folder, expected = saved
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    loaded = OscarCache.from_pretrained(folder)
    assert torch.equal(chunked_logits(model, loaded, input_ids), expected)
    eager = OscarCache.from_pretrained(str(folder), config=model.config)  # layers created up front
    assert torch.equal(chunked_logits(model, eager, input_ids), expected)
    # The artifact carries the calibration: the same settings without it give other logits.
    plain = OscarCache(sink_tokens=4, recent_tokens=8)
    assert not torch.allclose(chunked_logits(model, plain, input_ids), expected)
    assert loaded.calibration.layout_names == ("spectral+center", "per-channel")
    assert loaded.calibration.k_eigenvalues[1] is None and loaded.calibration.v_eigenvalues[1].shape == (HEAD_DIM,)
    assert loaded.calibration.info["num_tokens"] == 1234 and loaded.quality == QUALITY

    config = json.loads((folder / "config.json").read_text())
    assert config["format"] == "hf_kvint2.oscar" and config["format_version"] == hub.FORMAT_VERSION
    assert (config["num_layers"], config["num_key_value_heads"], config["head_dim"]) == (LAYERS, KV_HEADS, HEAD_DIM)
    assert config["base_model"] == "tiny/llama" and config["base_model_revision"] == "abc123"
    assert config["settings"]["k_clip"] == [0.95, None] and config["settings"]["scale_dtype"] == "float16"
    assert config["layers"][1]["key_layout"] == {"axis": "channel", "group_size": 8, "clip": None,
                                                 "token_scaling": False, "range_clip": 0.8}
    assert "range_clip" not in config["layers"][1]["value_layout"]  # written only where set
    assert loaded.calibration.layer_layouts[1][0].range_clip == 0.8
    assert sorted(load_file(folder / "model.safetensors")) == sorted(
        ["layers.0.key_rotation", "layers.0.key_eigenvalues", "layers.0.key_mean", "layers.0.value_rotation",
         "layers.0.value_eigenvalues", "layers.0.value_mean", "layers.1.value_rotation",
         "layers.1.value_eigenvalues", "layers.1.value_mean"])
    meta = card_metadata(folder / "README.md")
    assert meta["library_name"] == "hf_kvint2" and meta["base_model"] == "tiny/llama"
    assert {"kv-cache", "int2", "oscar"} <= set(meta["tags"])
    card = (folder / "README.md").read_text()
    assert "| OscarCache | 30.1 | 2.3 |" in card and "random tokens" in card


def test_saving_a_loaded_artifact_is_byte_identical(saved, tmp_path):
    folder, _ = saved
    again = OscarCache.from_pretrained(folder).save_pretrained(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name


@pytest.mark.parametrize("make", [
    lambda: OscarCache(k_clip=0.9, v_clip=None, sink_tokens=4, recent_tokens=8),
    lambda: OscarScaledCache(sink_tokens=0, recent_tokens=8, group_size=8, hadamard_block=8, scale_dtype=torch.bfloat16),
], ids=["hadamard-oscar", "oscar-scaled"])
def test_data_free_round_trip(make, model, input_ids, tmp_path):
    cache = make()
    expected = chunked_logits(model, cache, input_ids)
    folder = cache.save_pretrained(tmp_path)  # after use: records the shapes it saw
    assert sorted(os.listdir(folder)) == ["README.md", "config.json"]  # nothing calibrated, no tensors
    config = json.loads((folder / "config.json").read_text())
    assert config["format"] == cache.artifact_format and config["layers"] is None
    assert (config["num_key_value_heads"], config["head_dim"]) == (KV_HEADS, HEAD_DIM)
    loaded = type(cache).from_pretrained(folder)
    assert loaded.settings == cache.settings
    assert torch.equal(chunked_logits(model, loaded, input_ids), expected)
    other = OscarCache if isinstance(cache, OscarScaledCache) else OscarScaledCache
    with pytest.raises(ArtifactError, match=f"load it with {type(cache).__name__}.from_pretrained"):
        other.from_pretrained(folder)


def test_overrides_replace_settings(saved, model, input_ids):
    folder, expected = saved
    loaded = OscarCache.from_pretrained(folder, recent_tokens=16, k_clip=0.5)
    assert loaded.settings.recent_tokens == 16
    # k_clip also rewrites the calibrated per-layer key layouts, not just the unused default
    layouts = [loaded._recipe_for_layer(i).key.clip for i in range(LAYERS)]
    assert layouts == [0.5, 0.5]
    assert not torch.allclose(chunked_logits(model, loaded, input_ids), expected)
    with pytest.raises(TypeError, match="recent_tokenz"):
        OscarCache.from_pretrained(folder, recent_tokenz=3)


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("kw,at_first_use,with_config", [
    ({"kv_heads": 4}, "num_key_value_heads=2, but the model .* has num_key_value_heads=4",
     "num_key_value_heads=2, but the model config .* has num_key_value_heads=4"),
    ({"head_dim": 32}, "head_dim=16, but the model .* has head_dim=32", "head_dim=16, but the model config"),
    ({"layers": 3}, "num_layers=2, but the model has num_layers=at least 3", "num_layers=2, but the model config"),
    ({"layers": 1}, "num_layers=2, but the model has num_layers=1", "num_layers=2, but the model config"),
])
def test_mismatch_is_caught_at_first_use(saved, input_ids, kw, at_first_use, with_config):
    folder, _ = saved
    other = make_tiny_llama(**kw)
    cache = OscarCache.from_pretrained(folder)
    with pytest.raises(ArtifactError, match=at_first_use):
        chunked_logits(other, cache, input_ids)  # one layer fewer shows when the next forward starts
    with pytest.raises(ArtifactError, match=with_config):
        OscarCache.from_pretrained(folder, config=other.config)


def test_other_base_model_only_warns(saved, input_ids):
    folder, expected = saved
    renamed = make_tiny_llama(name="someone/tiny-llama-finetune")
    with pytest.warns(UserWarning, match="calibrated for 'tiny/llama' but the model is 'someone/tiny-llama-finetune'"):
        cache = OscarCache.from_pretrained(folder, config=renamed.config)
    assert torch.equal(chunked_logits(renamed, cache, input_ids), expected)
    with warnings.catch_warnings():  # a local copy keeps the last path component: no warning
        warnings.simplefilter("error")
        OscarCache.from_pretrained(folder, config=make_tiny_llama(name="/data/copies/LLAMA").config)


# ------------------------------------------------------------------------------------------------ Hub over HTTP
class _HubHandler(BaseHTTPRequestHandler):
    """The Hub's ``/<org>/<name>/resolve/<revision>/<path>`` route (GET and HEAD) from ``root/<org>/<name>/<rev>``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self, status, headers, body=b""):
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def _serve(self):
        self.server.requests.append((self.command, self.path, self.headers.get("authorization")))
        parts = [urllib.parse.unquote(p) for p in urllib.parse.urlsplit(self.path).path.strip("/").split("/")]
        if len(parts) < 5 or parts[2] != "resolve":
            return self._reply(404, {"X-Error-Code": "RepoNotFound"})
        repo = self.server.root / parts[0] / parts[1]
        revision_dir = repo / parts[3]
        if not repo.is_dir():
            return self._reply(401, {"X-Error-Code": "RepoNotFound"})
        if not revision_dir.is_dir():
            return self._reply(404, {"X-Error-Code": "RevisionNotFound"})
        commit = hashlib.sha1(f"{parts[0]}/{parts[1]}@{parts[3]}".encode()).hexdigest()
        path = revision_dir.joinpath(*parts[4:])
        if not path.is_file():
            return self._reply(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
        data = path.read_bytes()
        self._reply(200, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": commit,
                          "Content-Type": "application/octet-stream"}, data)

    do_GET = do_HEAD = _serve


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler)
    server.root, server.requests = root, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    # huggingface_hub reads HF_ENDPOINT at import; point its constants at the local server instead.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    yield server
    server.shutdown()
    server.server_close()


def test_hub_download_with_revision_and_subfolder_then_offline(hub_server, saved, model, input_ids, tmp_path,
                                                               monkeypatch):
    folder, expected = saved
    repo = hub_server.root / "kv-org" / "tiny-llama"
    OscarCache.from_pretrained(folder).save_pretrained(repo / "v1" / "oscar")  # the calibration in a subfolder
    OscarCache.from_pretrained(folder, recent_tokens=99).save_pretrained(repo / "main" / "oscar")
    (repo / "v1" / "config.json").write_text(json.dumps(model.config.to_dict()))  # the model's own config
    cache_dir = tmp_path / "hf-cache"
    args = {"subfolder": "oscar", "cache_dir": cache_dir, "token": "hf_test_token"}

    cache = OscarCache.from_pretrained("kv-org/tiny-llama", revision="v1", **args)
    assert torch.equal(chunked_logits(model, cache, input_ids), expected)
    assert OscarCache.from_pretrained("kv-org/tiny-llama", **args).settings.recent_tokens == 99  # main
    served = [(method, path) for method, path, _ in hub_server.requests]
    assert ("HEAD", "/kv-org/tiny-llama/resolve/v1/oscar/config.json") in served
    assert ("GET", "/kv-org/tiny-llama/resolve/v1/oscar/model.safetensors") in served
    resolve_auth = {auth for _, path, auth in hub_server.requests if "/resolve/" in path}
    assert resolve_auth == {"Bearer hf_test_token"}  # the token reaches the Hub
    assert (cache_dir / "models--kv-org--tiny-llama" / "refs" / "v1").is_file()

    with pytest.raises(OSError, match="has no config.json"):  # the model's folder is not an artifact
        OscarCache.from_pretrained("kv-org/tiny-llama", revision="v1", subfolder="missing", cache_dir=cache_dir)
    with pytest.raises(ArtifactError, match="no 'format' key"):  # the model's own config.json
        OscarCache.from_pretrained("kv-org/tiny-llama", revision="v1", cache_dir=cache_dir)

    # Offline: served from the cache layout, with the server gone.
    hub_server.shutdown()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    count = len(hub_server.requests)
    cache = OscarCache.from_pretrained("kv-org/tiny-llama", revision="v1", **args)
    assert torch.equal(chunked_logits(model, cache, input_ids), expected)
    assert OscarCache.from_pretrained("kv-org/tiny-llama", local_files_only=True, **args).settings.recent_tokens == 99
    assert len(hub_server.requests) == count
    with pytest.raises(OSError, match="not in the local Hub cache"):
        OscarCache.from_pretrained("kv-org/tiny-llama", revision="v2", **args)


def test_embedded_artifact_ids_load_without_network(saved, model, input_ids, monkeypatch, tmp_path):
    folder, expected = saved
    monkeypatch.setitem(hub.EMBEDDED_ARTIFACTS, "hf-kvint2/tiny-test-oscar", folder)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}")
    cache = OscarCache.from_pretrained("hf-kvint2/tiny-test-oscar", cache_dir=tmp_path)
    assert torch.equal(chunked_logits(model, cache, input_ids), expected)
    assert not any(tmp_path.iterdir())  # the Hub cache was never touched
    monkeypatch.setitem(hub.EMBEDDED_ARTIFACTS, "hf-kvint2/tiny-test-oscar", tmp_path / "not-installed")
    with pytest.raises(OSError, match="missing from this installation"):
        OscarCache.from_pretrained("hf-kvint2/tiny-test-oscar")


# ------------------------------------------------------------------------------------------------ push
def test_push_to_hub_uploads_the_artifact(monkeypatch, saved):
    folder, _ = saved
    calls = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw, self.token))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        files = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        calls.append(("upload_folder", repo_id, kw, files))
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    cache = OscarCache.from_pretrained(folder)
    result = cache.push_to_hub("me/tiny-llama", subfolder="kv-oscar", token="hf_secret", private=True,
                               quality=QUALITY[:1])
    assert result == "commit-info"
    (_, repo_id, create_kw, token), (_, up_repo, up_kw, files) = calls
    assert (repo_id, token, create_kw) == ("me/tiny-llama", "hf_secret", {"private": True, "exist_ok": True})
    assert up_repo == "me/tiny-llama" and up_kw["path_in_repo"] == "kv-oscar"
    assert sorted(files) == ["README.md", "config.json", "model.safetensors"]
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    config = json.loads(files["config.json"])
    assert config["format"] == "hf_kvint2.oscar" and config["quality"] == QUALITY[:1]
    card = files["README.md"].decode()
    meta = ModelCard(card).data.to_dict()
    assert meta["library_name"] == "hf_kvint2" and meta["base_model"] == "tiny/llama"
    assert {"kv-cache", "int2", "oscar"} <= set(meta["tags"])
    assert 'OscarCache.from_pretrained("me/tiny-llama", subfolder="kv-oscar", config=model.config)' in card
    assert "| DynamicCache | 28.79 | 16 |" in card


# ------------------------------------------------------------------------------------------------ broken files
def _copy_artifact(src, dst, edit_config=None, edit_tensors=None):
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("edit_config,edit_tensors,message", [
    (None, lambda t: t.update({"layers.0.key_rotation": torch.eye(HEAD_DIM + 1)}), r"shape \(17, 17\), expected"),
    (None, lambda t: t.update({"layers.0.value_mean": torch.zeros(KV_HEADS + 1, HEAD_DIM)}), r"expected \(2, 16\)"),
    (None, lambda t: t["layers.0.key_rotation"].mul_(1.1), "not orthogonal"),
    (None, lambda t: t["layers.1.value_mean"].__setitem__((0, 3), float("nan")), "NaN"),
    (None, lambda t: t.pop("layers.1.value_rotation"), "'layers.1.value_rotation' is listed .* but missing"),
    (None, lambda t: t.update({"layers.5.key_rotation": torch.eye(HEAD_DIM)}), "does not list"),
    (lambda c: c["layers"].pop(), None, "lists 1 layers but num_layers is 2: layers are missing"),
    (lambda c: c.update(format_version=2), None,
     "format_version 2 is newer .* update hf_kvint2 from the source you installed it from"),
    (lambda c: c.update(format_version="1"), None, "unknown format_version '1'"),
    (lambda c: c.update(format="someone.else"), None, "format is 'someone.else'"),
    (lambda c: c.pop("format"), None, "no 'format' key"),
    (lambda c: c.update(head_dim=-4), None, "head_dim must be a positive integer"),
    (lambda c: c["settings"].update(scale_dtype="int8"), None, "scale_dtype 'int8'"),
    (lambda c: c["settings"].update(new_knob=1), None, r"unknown settings \['new_knob'\]"),
    (lambda c: c["layers"][0]["key_layout"].update(axis="diagonal"), None, "invalid layout"),
    (lambda c: c["layers"][0]["key_layout"].update(group_size=1 << 20), None,
     r"layout's group_size must be an integer in \[1, 65536\].* got 1048576"),
    (lambda c: c["layers"][1]["value_layout"].update(group_size=True), None, "layout's group_size .* got True"),
    (lambda c: c["settings"].update(k_clip=[0.9]), None, "k_clip lists 1 clip ratios but num_layers is 2"),
    (lambda c: c["settings"].update(v_clip=1.5), None, r"v_clip ratios must be numbers in \(0, 1\]"),
    (lambda c: c["layers"][1]["key_layout"].update(range_clip=1.7), None, "range_clip must be a fraction"),
    (lambda c: c["layers"][0]["key_layout"].update(range_clip=0.8), None, "per-token groups"),
], ids=["wrong-rotation-shape", "wrong-mean-shape", "non-orthogonal", "nan", "missing-tensor", "unexpected-tensor",
        "missing-layer", "newer-version", "bad-version", "other-format", "not-an-artifact", "bad-shape-value",
        "bad-scale-dtype", "unknown-setting", "bad-layout", "layout-group-too-large", "layout-group-bool",
        "clip-count", "clip-range", "range-clip-range", "range-clip-on-token-groups"])
def test_broken_artifacts_get_clear_errors(saved, tmp_path, edit_config, edit_tensors, message):
    folder, _ = saved
    broken = _copy_artifact(folder, tmp_path / "broken", edit_config, edit_tensors)
    with pytest.raises(ArtifactError, match=message):
        OscarCache.from_pretrained(broken)


def test_unreadable_files_get_clear_errors(saved, tmp_path):
    folder, _ = saved
    broken = _copy_artifact(folder, tmp_path / "json")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="config.json is not valid JSON"):
        OscarCache.from_pretrained(broken)
    broken = _copy_artifact(folder, tmp_path / "truncated")
    (broken / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        OscarCache.from_pretrained(broken)
    with pytest.raises(OSError, match="neither a local folder nor a valid Hub repo id"):
        OscarCache.from_pretrained("./no/such/../folder")


class _Payload:
    """Unpickling this runs ``os.mkdir(marker)``: the classic pickle attack, made harmless and observable."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickle_payloads_are_never_executed(saved, tmp_path):
    folder, _ = saved
    rotation = random_rotation(3)[0].float()
    # The payload is live: a plain unpickle would run it.
    live = tmp_path / "live-marker"
    torch.save({"layers": {0: {"rotation": _Payload(live)}}}, tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert live.exists()

    marker = tmp_path / "pwned"
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    torch.save({"format_version": 1, "objective": "qqt", "layers": {0: {"rotation": _Payload(marker)}}},
               zoo / "k_rotation_qqt_r_h_pbr.pt")
    torch.save({"format_version": 1, "objective": "sst", "layers": {0: {"rotation": rotation}}},
               zoo / "v_rotation_sst_r_h_pbr.pt")
    with pytest.raises(ArtifactError, match=r"refusing to load it.*weights_only=True"):
        OscarCache.from_rotation_zoo(zoo)
    # A pickle disguised as our tensors file is rejected by safetensors, never unpickled.
    disguised = _copy_artifact(folder, tmp_path / "disguised")
    torch.save({"layers.0.key_rotation": _Payload(marker)}, disguised / "model.safetensors")
    with pytest.raises(ArtifactError, match="not a readable safetensors file"):
        OscarCache.from_pretrained(disguised)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ RotationZoo
def _write_zoo(folder, k_layers, v_layers):
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"format_version": 1, "objective": "qqt", "layers": k_layers}, folder / "k_rotation_qqt_r_h_pbr.pt")
    torch.save({"format_version": 1, "objective": "sst", "layers": v_layers}, folder / "v_rotation_sst_r_h_pbr.pt")
    return folder


def test_rotation_zoo_import(model, input_ids, tmp_path, hub_server):
    rots = [random_rotation(20 + i) for i in range(2 * LAYERS)]
    k_layers = {i: {"rotation": rots[i][0].float(), "eigenvalues": rots[i][1].float()} for i in range(LAYERS)}
    # value file keyed by strings with explicit layer ids, in reverse order: both spellings occur in the wild
    v_layers = {str(i): {"layer_id": i, "rotation": rots[LAYERS + i][0].float(), "eigenvalues": rots[LAYERS + i][1]}
                for i in reversed(range(LAYERS))}
    zoo = _write_zoo(tmp_path / "zoo" / "TinyLlama" / "seq100_group16", k_layers, v_layers)
    settings = {"sink_tokens": 4, "recent_tokens": 8}
    direct = OscarCache(k_rotations=[rots[i][0].float() for i in range(LAYERS)],
                        v_rotations=[rots[LAYERS + i][0].float() for i in range(LAYERS)], **settings)
    expected = chunked_logits(model, direct, input_ids)

    imported = OscarCache.from_rotation_zoo(tmp_path / "zoo", subfolder="TinyLlama/seq100_group16", **settings)
    assert imported.settings.k_clip == 0.96 and imported.settings.v_clip == 0.92  # reference defaults
    assert torch.equal(chunked_logits(model, imported, input_ids), expected)
    assert torch.equal(imported.calibration.k_eigenvalues[1], rots[1][1].float())
    # converted to our format, it round-trips
    converted = OscarCache.from_pretrained(imported.save_pretrained(tmp_path / "converted"))
    assert torch.equal(chunked_logits(model, converted, input_ids), expected)
    # from a Hub repo over HTTP
    repo_zoo = hub_server.root / "Zhongzhu" / "OSCAR-RotationZoo" / "main"
    _write_zoo(repo_zoo / "TinyLlama", k_layers, v_layers)
    from_hub = OscarCache.from_rotation_zoo("Zhongzhu/OSCAR-RotationZoo", subfolder="TinyLlama",
                                            cache_dir=tmp_path / "hf-cache", **settings)
    assert torch.equal(chunked_logits(model, from_hub, input_ids), expected)
    # shapes are checked at first use like any artifact
    with pytest.raises(ArtifactError, match="head_dim=16, but the model .* has head_dim=32"):
        chunked_logits(make_tiny_llama(head_dim=32), OscarCache.from_rotation_zoo(zoo), input_ids)


@pytest.mark.parametrize("edit,message", [
    (lambda k: k[0].update(rotation=k[0]["rotation"] * 2), "not orthogonal"),
    (lambda k: k.pop(0), r"layers \[0\] are missing"),
    (lambda k: k[0].update(rotation=torch.eye(HEAD_DIM).expand(2, HEAD_DIM, HEAD_DIM).clone()), "per-head"),
    (lambda k: k[1].update(rotation=torch.eye(HEAD_DIM + 4)), r"shape \(20, 20\), expected \(16, 16\)"),
    (lambda k: k[1].update(eigenvalues=torch.full((HEAD_DIM,), float("nan"))), "eigenvalues must be a finite"),
    (lambda k: k[1].pop("rotation"), "no 'rotation' tensor"),
])
def test_broken_rotation_zoo_files(tmp_path, edit, message):
    def layers():
        return {i: {"rotation": random_rotation(30 + i)[0].float(), "eigenvalues": torch.ones(HEAD_DIM)}
                for i in range(LAYERS)}
    k_layers = layers()
    edit(k_layers)
    zoo = _write_zoo(tmp_path / "zoo", k_layers, layers())
    with pytest.raises(ArtifactError, match=message):
        OscarCache.from_rotation_zoo(zoo)
    torch.save({"rotations": []}, zoo / "k_rotation_qqt_r_h_pbr.pt")
    with pytest.raises(ArtifactError, match="not a RotationZoo rotation file"):
        OscarCache.from_rotation_zoo(zoo)


# ------------------------------------------------------------------------------------------------ shipped artifact
SMOLLM2_SHAPES = {"num_layers": 30, "num_key_value_heads": 3, "head_dim": 64}


def test_shipped_smollm2_artifact_loads_offline(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    cache = OscarCache.from_pretrained(hub.SMOLLM2_ARTIFACT_ID, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())
    info = cache.artifact_info
    assert {k: info[k] for k in SMOLLM2_SHAPES} == SMOLLM2_SHAPES
    assert info["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert len(cache.calibration.layer_layouts) == 30 and len(cache.calibration.layout_names) == 30
    assert "prideprejudice" in cache.calibration.info["data"].lower().replace(" ", "").replace("_", "")
    meta = card_metadata(hub.SMOLLM2_ARTIFACT_DIR / "README.md")
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "oscar" in meta["tags"]
    # against SmolLM2's architecture (no weights needed): the shapes fit
    smollm2_config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3)
    smollm2_config.name_or_path = "/home/me/.cache/hf_kvint2/smollm2-135m-instruct"  # a local copy: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OscarCache.from_pretrained(hub.SMOLLM2_ARTIFACT_ID, config=smollm2_config)


def test_shipped_artifacts_are_package_data():
    import fnmatch
    import re

    root = Path(hub.__file__).parents[1]
    line = re.search(r'^"hf_kvint2" = (\[.*\])$', (root.parent / "pyproject.toml").read_text(), re.MULTILINE)
    patterns = json.loads(line.group(1))  # the [tool.setuptools.package-data] entry of the package itself
    shipped = [p.relative_to(root).as_posix() for p in hub.EMBEDDED_ARTIFACTS_DIR.rglob("*") if p.is_file()]
    assert shipped and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in shipped), shipped
    for artifact_id, folder in hub.EMBEDDED_ARTIFACTS.items():
        assert {p.name for p in folder.iterdir()} >= {"config.json", "README.md"}, artifact_id


@pytest.mark.slow
def test_shipped_artifact_runs_on_smollm2(smollm2):
    model, tokenizer = smollm2
    text = (Path(hub.__file__).parents[1] / "data" / "emma.txt").read_text(encoding="utf-8")[20000:24000]
    # > sink 64 + recent 256 + the largest per-channel group the calibration may choose (256 tokens; layer 0's keys
    # use it): every layer's body is used
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :640]
    cache = OscarCache.from_pretrained(hub.SMOLLM2_ARTIFACT_ID, config=model.config)  # checked against the model

    def run(c):
        with torch.no_grad():
            return torch.cat([model(ids[:, s:s + 320], past_key_values=c).logits for s in (0, 320)], dim=1)

    logits = run(cache)
    assert ids.shape[1] == 640 and torch.isfinite(logits).all() and all(layer.body_len > 0 for layer in cache.layers)
    assert not torch.equal(logits, run(OscarCache()))  # the calibration is in effect
    with pytest.raises(ArtifactError, match="num_key_value_heads=3, but the model .* has num_key_value_heads=2"):
        chunked_logits(make_tiny_llama(kv_heads=2, head_dim=64), OscarCache.from_pretrained(
            hub.SMOLLM2_ARTIFACT_ID), torch.zeros(1, 8, dtype=torch.long))


def test_layers_sharing_one_tensor_save_and_load(tmp_path):
    """The same rotation given for every layer (e.g. one Hadamard) is saved as one tensor per layer (safetensors
    refuses tensors that share memory)."""
    hadamard = torch.eye(HEAD_DIM)
    cache = OscarCache(k_rotations=[hadamard] * LAYERS, v_rotations=[hadamard] * LAYERS, sink_tokens=4,
                       recent_tokens=8)
    loaded = OscarCache.from_pretrained(cache.save_pretrained(tmp_path))
    assert all(torch.equal(r, hadamard) for r in loaded.calibration.k_rotations + loaded.calibration.v_rotations)


def test_layouts_without_tensors_round_trip(model, input_ids, tmp_path):
    """Calibrated layouts with the built-in Hadamard and no means are saved without model.safetensors (there is
    nothing to put in it), and load from what was saved."""
    cache = OscarCache(layer_layouts=[(GroupLayout("token", 16, 0.9), GroupLayout("channel", 8))] * LAYERS,
                       sink_tokens=4, recent_tokens=8)
    expected = chunked_logits(model, cache, input_ids)
    folder = cache.save_pretrained(tmp_path)
    assert not (folder / "model.safetensors").exists()
    loaded = OscarCache.from_pretrained(folder)
    assert loaded.calibration.layer_layouts == cache.calibration.layer_layouts
    assert torch.equal(chunked_logits(model, loaded, input_ids), expected)
