"""Without network (and without HF_HUB_OFFLINE), loading an artifact from the Hub fails at once with a message
that says so and how to fix it, instead of retrying and blaming a disabled download."""

from __future__ import annotations

import socket
import threading

import huggingface_hub
import pytest

from hf_kvint2 import OscarCache, network


def test_unreachable_hub_fails_fast_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(network, "hub_reachable", lambda timeout=network.PROBE_SECONDS: False)
    connections = []  # after the probe says no, nothing tries the network (huggingface_hub would retry)
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: connections.append(address))
    with pytest.raises(OSError, match=r"cannot be reached from here \(no network\?\).*HF_HUB_OFFLINE=1") as err:
        OscarCache.from_pretrained("someone/not-cached-anywhere", cache_dir=tmp_path)
    assert connections == []
    assert "downloading is disabled" not in str(err.value)


def test_offline_mode_names_the_setting(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set"):
        OscarCache.from_pretrained("someone/not-cached-anywhere", cache_dir=tmp_path)
    with pytest.raises(OSError, match="local_files_only=True"):
        OscarCache.from_pretrained("someone/not-cached-anywhere", cache_dir=tmp_path, local_files_only=True)


def test_probe_sees_a_listening_endpoint_and_a_closed_one(monkeypatch):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepting = threading.Thread(target=lambda: server.accept()[0].close(), daemon=True)
    accepting.start()
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(network, "hub_endpoint", lambda: f"http://127.0.0.1:{port}")
    assert network.hub_reachable(timeout=2)
    # Closed only once the accept has returned: a socket closed while another thread blocks in accept() on it
    # keeps listening on Linux, and the second probe would connect.
    accepting.join()
    server.close()
    assert not network.hub_reachable(timeout=2)
