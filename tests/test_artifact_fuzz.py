"""Fixed-seed fuzzing of calibration artifacts: mutated ``config.json`` (values swapped for values of
other types and ranges, keys dropped or added, layout fields, calibrated-layer lists, strings the model card
renders, huge integer literals, bytes flipped, truncated, random) and ``model.safetensors`` (header fields changed,
bytes flipped, truncated, random). Every case ends in a loaded cache that runs an update and saves again (its card
renders every string as text, its usage snippet is the expected code) and loads from what it saved, or in an
``ArtifactError`` / ``ValueError`` with a message: never another exception type, never a hang (each case has a
deadline far above its cost, a hang detector), never a large allocation (peak RSS of the whole run is bounded). Also fuzzed: which layers an artifact
calibrates against which layers a model quantizes (loads exactly when they agree), and RotationZoo archives of
random storage counts and sizes (refused from the zip index or loaded within a bounded peak)."""

from __future__ import annotations

import ast
import collections
import io
import json
import pickle
import random
import re
import resource
import signal
import struct
import zlib

import pytest
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM

import hf_kvint2  # noqa: F401  (registers the "oscar" attention)
from hf_kvint2 import GroupLayout, OscarCache
from hf_kvint2.hub import ArtifactError, safety
from hf_kvint2.model_config import quantized_layers
from hf_kvint2.static_cache import StaticOscarCache

CASES = 240
SEED = 12
# Per case: loading, saving and one update take milliseconds; the first update of a new layout may compile a CPU
# kernel (tens of seconds on a busy 2-core machine without a kernel cache), which must not count as a hang.
CASE_DEADLINE_S = 120
KV_HEADS, HEAD_DIM, LAYERS = 2, 16, 2
# Values a hostile or corrupt config might hold where any other value was (types and extremes).
ODD_VALUES = [None, True, False, 0, -1, 1, 3, 2**31, 10**18, -(10**18), 1e308, -1e-308, float("nan"), 0.5, "",
              "false", "abc", "float16", "hf_kvint2.oscar", [], [1], [[1, 2]], [None], {}, {"a": 1},
              {"axis": "token"}, [[[[[[[[1]]]]]]]], "../../etc/passwd", "\x00", "𝔘"]


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _set(root, path, value):
    node = root
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _delete(root, path):
    node = root
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]


# Strings that would be code, markup or unencodable text if a card pasted them verbatim.
CARD_STRINGS = ['x")\nimport os; os.system("echo pwned")  #', "<script>alert(1)</script>", "a | b\n| c | d |",
                "[link](javascript:alert(1))", "`code`", "lone \udc80 surrogate", "![img](http://x/y.png)",
                "<!-- hidden -->", "back\\slash", "google/gemma-3-270m", "org/name_1.0-x"]
LAYOUT_FIELDS = {"axis": ["token", "channel", "Token", ["token"]], "group_size": [8, "8", 8.0, True, 0],
                 "clip": [0.9, "0.9", 1.5, True, None], "token_scaling": [True, "false", 0, None],
                 "range_clip": [0.8, "0.8", 0, None]}


def mutate_config(rng: random.Random, text: str) -> bytes:
    config = json.loads(text)
    kind = rng.choice(["value", "value", "value", "delete", "add", "layout", "plan", "card", "bigint", "bytes",
                       "truncate", "random"])
    if kind == "layout":  # one field of a calibrated layout: a plausible value or one of another type
        layout = config["layers"][rng.randrange(LAYERS)][rng.choice(["key_layout", "value_layout"])]
        name = rng.choice(sorted(LAYOUT_FIELDS))
        layout[name] = rng.choice(LAYOUT_FIELDS[name] + ODD_VALUES[:12])
        return json.dumps(config).encode()
    if kind == "plan":  # which layers the artifact says it calibrates, with or without their layouts
        config["calibrated_layers"] = rng.choice([[0], [1], [0, 1], [1, 0], [], [2], [0, 0], "0", [True], None])
        if rng.random() < 0.5:
            entry = config["layers"][rng.randrange(LAYERS)]
            entry["key_layout"] = entry["value_layout"] = None
        return json.dumps(config).encode()
    if kind == "card":  # a string the model card renders
        value = rng.choice(CARD_STRINGS)
        where = rng.choice(["base_model", "base_model_revision", "quality", "data", "layout", "layer_types"])
        if where == "quality":
            config["quality"] = [{"cache": value, value: 1.5}, {"cache": "OscarCache", "note": value}]
        elif where == "data":
            config["calibration"] = {"data": value, "num_tokens": value, "window": 64}
        elif where == "layout":
            config["layers"][rng.randrange(LAYERS)]["layout"] = value
        elif where == "layer_types":
            config["calibration"] = {"layer_types": [value] * LAYERS}
            config["calibrated_layers"] = [1]
            config["layers"][0]["key_layout"] = config["layers"][0]["value_layout"] = None
            config["layers"][0].update(key_rotation=False, value_rotation=False, key_mean=False)
        else:
            config[where] = value
        return json.dumps(config).encode()
    if kind == "bigint":  # an integer literal beyond Python's 4300-digit conversion limit
        return text.replace('"num_layers": 2', '"num_layers": ' + "7" * 5000, 1).encode()
    if kind in ("value", "delete", "add"):
        paths = [p for p in _paths(config) if p]
        path = rng.choice(paths)
        if kind == "value":
            _set(config, path, rng.choice(ODD_VALUES))
        elif kind == "delete":
            _delete(config, path)
        else:
            parent = config
            for p in path[:-1]:
                parent = parent[p]
            if isinstance(parent, dict):
                parent[rng.choice(["new_key", "settings", "layers", "k_rotations"])] = rng.choice(ODD_VALUES)
            else:
                parent.append(rng.choice(ODD_VALUES))
        return json.dumps(config).encode()
    data = bytearray(text.encode())
    if kind == "bytes":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == "truncate":
        return bytes(data[:rng.randrange(len(data))])
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 2000)))


def mutate_tensors(rng: random.Random, raw: bytes) -> bytes:
    kind = rng.choice(["header", "header", "bytes", "data", "truncate", "random", "length"])
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    if kind == "header":
        name = rng.choice([k for k in header if k != "__metadata__"])
        field = rng.choice(["shape", "dtype", "data_offsets", "name"])
        if field == "shape":
            header[name]["shape"] = rng.choice([[HEAD_DIM], [HEAD_DIM * 2, HEAD_DIM * 2], [10**6, 10**6], [0, 0],
                                                [], [-1, 16], ["a"], [2**62, 2**62]])
        elif field == "dtype":
            header[name]["dtype"] = rng.choice(["F16", "BF16", "F64", "I64", "U8", "BOOL", "XYZ", 3])
        elif field == "data_offsets":
            header[name]["data_offsets"] = rng.choice([[0, 2**62], [-8, 8], [0], ["a", "b"], [10**9, 10**9 + 1024]])
        else:
            header[f"layers.{rng.randint(0, 50)}.key_rotation"] = header.pop(name)
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + body
    if kind == "length":
        return struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, 2**40, 2**64 - 1])) + raw[8:]
    data = bytearray(raw)
    if kind == "bytes":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == "data":  # flip bytes inside the tensors only: NaN, non-orthogonal, huge means
        for _ in range(rng.randint(1, 4)):
            data[8 + n + rng.randrange(len(body))] = rng.randrange(256)
        return bytes(data)
    if kind == "truncate":
        return bytes(data[:rng.randrange(len(data))])
    return bytes(rng.randrange(256) for _ in range(rng.randint(0, 4000)))


def calibrated_cache():
    g = torch.Generator().manual_seed(0)
    rots = [torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=g, dtype=torch.float64))[0].float()
            for _ in range(2 * LAYERS)]
    return OscarCache(k_rotations=rots[:LAYERS], v_rotations=rots[LAYERS:], k_clip=[0.95, None],
                      key_means=[torch.randn(KV_HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)],
                      layer_layouts=[(GroupLayout("token", 16, 0.95), GroupLayout("token", 8, 0.9)),
                                     (GroupLayout("channel", 4), GroupLayout("token", 16))],
                      sink_tokens=2, recent_tokens=4)


# ---------------------------------------------------------------------------------------------- RotationZoo archives
_ZEROS = bytes(1 << 20)


class _Storage:
    """One storage record of a ``torch.save`` archive (pickled as the persistent id torch.save writes)."""

    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _Rotation:
    """A float64 [d, d] tensor over a :class:`_Storage`, pickled as torch.save pickles a tensor."""

    def __init__(self, storage: _Storage, d: int):
        self.storage, self.d = storage, d

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, (self.d, self.d), (self.d, 1), False,
                                                 collections.OrderedDict())


class _ArchivePickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", torch.DoubleStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _Storage) else None


def write_zoo_archive(path, sizes, deflate: bool) -> None:
    """A RotationZoo ``.pt`` as ``torch.save`` lays it out (``archive/data.pkl`` + one record per storage), whose
    layer ``i`` rotation is an all-zero float64 ``[sizes[i], sizes[i]]`` tensor, written without holding any storage
    in memory: deflated (one compressed stream of zeros, shared by equal sizes) or stored as holes of a sparse file."""
    storages = [_Storage(str(i), d * d) for i, d in enumerate(sizes)]
    pkl = io.BytesIO()
    _ArchivePickler(pkl, protocol=2).dump({"format_version": 1, "objective": "qqt", "layers": {
        i: {"rotation": _Rotation(s, d)} for i, (s, d) in enumerate(zip(storages, sizes))}})
    streams = {}
    with open(path, "wb") as f:
        central = bytearray()

        def entry(name, size, crc, payload, method, hole=0):
            offset, raw = f.tell(), f"archive/{name}".encode()
            compressed = len(payload) + hole
            f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, compressed, size,
                                len(raw), 0) + raw + payload)
            f.seek(hole, io.SEEK_CUR)
            central.extend(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, compressed,
                                       size, len(raw), 0, 0, 0, 0, 0, offset) + raw)

        for name, data in (("data.pkl", pkl.getvalue()), ("byteorder", b"little"), ("version", b"3\n")):
            entry(name, len(data), zlib.crc32(data), data, 0)
        for s in storages:
            size = 8 * s.numel
            if size not in streams:
                crc, packer, parts = 0, zlib.compressobj(9, zlib.DEFLATED, -15), []
                for start in range(0, size, len(_ZEROS)):
                    chunk = _ZEROS[:min(len(_ZEROS), size - start)]
                    crc = zlib.crc32(chunk, crc)
                    if deflate:
                        parts.append(packer.compress(chunk))
                streams[size] = (crc, b"".join(parts) + packer.flush() if deflate else b"")
            crc, packed = streams[size]
            entry(f"data/{s.key}", size, crc, packed, 8 if deflate else 0, hole=0 if deflate else size)
        end = f.tell()
        f.write(central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(sizes) + 3, len(sizes) + 3, len(central),
                                      end, 0))


class Deadline(Exception):
    pass


def _alarm(*_):
    raise Deadline


def test_fuzzed_artifacts_load_or_fail_with_an_artifact_error(tmp_path):
    torch.set_num_threads(1)
    base = calibrated_cache().save_pretrained(tmp_path / "base")
    config_text = (base / "config.json").read_text()
    tensors_raw = (base / "model.safetensors").read_bytes()
    rng = random.Random(SEED)
    kv = torch.randn(1, KV_HEADS, 12, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    outcomes = {"loaded": 0, "refused": 0}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(CASES):
            folder = tmp_path / f"case{case}"
            folder.mkdir()
            which = rng.choice(["config", "tensors", "both"])
            config = mutate_config(rng, config_text) if which != "tensors" else config_text.encode()
            tensors = mutate_tensors(rng, tensors_raw) if which != "config" else tensors_raw
            (folder / "config.json").write_bytes(config)
            (folder / "model.safetensors").write_bytes(tensors)
            signal.alarm(CASE_DEADLINE_S)
            try:
                cache = OscarCache.from_pretrained(folder)
            except ValueError as e:  # ArtifactError is a ValueError
                assert str(e), f"case {case}: an empty error message"
                outcomes["refused"] += 1
                continue
            except Deadline:
                pytest.fail(f"case {case} ({which}) did not finish within {CASE_DEADLINE_S} s")
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"case {case} ({which}) raised {type(e).__name__}: {e}\nconfig: {config[:600]!r}")
            finally:
                signal.alarm(0)
            signal.alarm(CASE_DEADLINE_S)
            try:  # what loads runs, saves again, renders a card of plain text and loads from what it saved
                again = cache.save_pretrained(folder / "again")
                check_card((again / "README.md").read_text(), json.loads((again / "config.json").read_text()))
                OscarCache.from_pretrained(again)
                for layer in range(LAYERS):
                    cache.update(kv, kv, layer)
                outcomes["loaded"] += 1
            except ValueError as e:  # refused at the first update (shapes the config did not record)
                assert str(e), f"case {case}: an empty error message"
                outcomes["refused"] += 1
            except Deadline:
                pytest.fail(f"case {case} ({which}) did not finish within {CASE_DEADLINE_S} s")
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"case {case} ({which}) raised {type(e).__name__}: {e}\nconfig: {config[:600]!r}")
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 300, f"peak RSS grew by {grown_mb:.0f} MB while fuzzing"
    assert outcomes["refused"] > CASES // 2 and outcomes["loaded"] > 0, outcomes
    assert ArtifactError  # the class the refusals use (a ValueError)


def check_card(card: str, config: dict) -> None:
    """The card shows every artifact string as text (no HTML, no extra table rows), and its usage snippet is the
    expected code, quoting the config's base model."""
    for markup in ("<script", "<img", "<!--"):
        assert markup not in card, markup
    assert not re.search(r"(?<!\\)\]\(javascript", card)  # a link, unless its bracket is escaped
    rows = [line for line in card.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert len(rows) == LAYERS and all(line.replace("\\|", "").count("|") == 10 for line in rows), rows
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    tree = ast.parse(snippet)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [
        ("transformers", ["AutoModelForCausalLM", "AutoTokenizer"]), ("hf_kvint2", ["OscarCache"])]
    assert all(isinstance(node, (ast.ImportFrom, ast.Assign)) for node in tree.body)
    model_call = tree.body[2].value
    assert ast.literal_eval(model_call.args[0]) == (config["base_model"] or "<base model id>")


PLAN_CASES = 16


def _plan_artifact(folder, calibrated: list[int]):
    """A 4-layer artifact that calibrates exactly ``calibrated`` (config.json lists them in calibrated_layers)."""
    g = torch.Generator().manual_seed(len(calibrated))
    rot = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=g, dtype=torch.float64))[0].float()
    pair = (GroupLayout("token", 16, 0.95), GroupLayout("token", 16, 0.9))
    cache = OscarCache(k_rotations=[rot if i in calibrated else None for i in range(4)],
                       layer_layouts=[pair if i in calibrated else None for i in range(4)], sink_tokens=2,
                       recent_tokens=4)
    cache.calibration_info = {"num_layers": 4, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}
    return cache.save_pretrained(folder)


@torch.no_grad()
def _use_plan_artifact(how: str, folder, config, ids) -> None:
    if how == "config":
        OscarCache.from_pretrained(folder, config=config)
    elif how == "learned":  # no config=: the "oscar" attention tells the cache the layer types at the first forward
        model = AutoModelForCausalLM.from_config(config, attn_implementation="oscar").eval()
        model(ids, past_key_values=OscarCache.from_pretrained(folder))
    else:
        StaticOscarCache.from_cache(OscarCache.from_pretrained(folder), config, 32)


def test_fuzzed_layer_plans_load_only_onto_a_model_that_quantizes_the_calibrated_layers(tmp_path):
    """An artifact's calibrated layers against a model's layer types: it loads (with ``config=``, learning the
    types from the "oscar" attention, or into a static cache) exactly when they are the layers the model quantizes;
    otherwise an ArtifactError names both plans."""
    torch.set_num_threads(1)
    rng = random.Random(SEED)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(PLAN_CASES):
        types = [rng.choice(["full_attention", "sliding_attention"]) for _ in range(4)]
        config = tiny_config("qwen2", num_hidden_layers=4, layer_types=types, sliding_window=6,
                             use_sliding_window=True, head_dim=HEAD_DIM)
        quantized = quantized_layers(config)
        calibrated = quantized if quantized and rng.random() < 0.5 else sorted(rng.sample(range(4), rng.randint(1, 4)))
        folder = _plan_artifact(tmp_path / f"plan{case}", calibrated)
        plans = rf"calibrates layers {re.escape(str(calibrated))}, but .* quantizes layers {re.escape(str(quantized))}"
        for how in ("config", "learned", "static"):
            if calibrated == quantized:
                _use_plan_artifact(how, folder, config, ids)
                outcomes["loaded"] += 1
            else:
                with pytest.raises(ArtifactError, match=plans):
                    _use_plan_artifact(how, folder, config, ids)
                outcomes["refused"] += 1
    assert outcomes["loaded"] and outcomes["refused"], outcomes


ZOO_CASES = 40


def test_fuzzed_rotation_zoo_archives_are_bounded_by_their_zip_index(tmp_path):
    """RotationZoo archives of random storage counts and sizes, deflated or stored (sparse): each is refused with
    an ArtifactError (from the zip index, or the zero rotations' orthogonality check), never another exception,
    and what loading allocates stays within the bound the index check enforces."""
    torch.set_num_threads(1)
    rng = random.Random(SEED)
    config = tiny_config("llama", head_dim=HEAD_DIM)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused_by_index = 0
    for case in range(ZOO_CASES):
        folder = tmp_path / f"zoo{case}"
        folder.mkdir()
        sizes = [rng.choice([4, 16, 64, 512, 2048])] * rng.randint(1, 64)
        deflate = rng.random() < 0.5
        for kind, method in (("k", "qqt_r_h_pbr"), ("v", "sst_r_h_pbr")):
            write_zoo_archive(folder / f"{kind}_rotation_{method}.pt", sizes, deflate)
        with pytest.raises(ArtifactError) as refused:
            OscarCache.from_rotation_zoo(folder, config=config if rng.random() < 0.5 else None)
        refused_by_index += "declares" in str(refused.value) or "compressed" in str(refused.value)
        for path in folder.iterdir():
            path.unlink()  # sparse, but free the blocks the deflated ones hold
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < safety.MAX_ZOO_BYTES / 2**20 + 128, f"peak RSS grew by {grown_mb:.0f} MB"
    assert 0 < refused_by_index < ZOO_CASES
