"""Fixed-seed fuzzing of calibration artifacts: mutated ``config.json`` (values swapped for values of
other types and ranges, keys dropped or added, bytes flipped, truncated, random) and ``model.safetensors``
(header fields changed, bytes flipped, truncated, random). Every case ends in a loaded cache that runs an
update, or in an ``ArtifactError`` / ``ValueError`` with a message: never another exception type, never a hang
(each case has a deadline), never a large allocation (peak RSS of the whole run is bounded)."""

from __future__ import annotations

import json
import random
import resource
import signal
import struct

import pytest
import torch

from hf_kvint2 import GroupLayout, OscarCache
from hf_kvint2.hub import ArtifactError

CASES = 240
SEED = 12
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


def mutate_config(rng: random.Random, text: str) -> bytes:
    config = json.loads(text)
    kind = rng.choice(["value", "value", "value", "delete", "add", "bytes", "truncate", "random"])
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
            signal.alarm(10)
            try:
                cache = OscarCache.from_pretrained(folder)
                for layer in range(LAYERS):
                    cache.update(kv, kv, layer)
                outcomes["loaded"] += 1
            except ValueError as e:  # ArtifactError is a ValueError
                assert str(e), f"case {case}: an empty error message"
                outcomes["refused"] += 1
            except Deadline:
                pytest.fail(f"case {case} ({which}) did not finish within 10 s")
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
