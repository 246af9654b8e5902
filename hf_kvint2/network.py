"""Is the Hugging Face Hub reachable? A quick probe, so that a machine without network fails in seconds with a
message that says so, instead of after huggingface_hub's retries with a message about the disk cache."""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

PROBE_SECONDS = 3.0


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = PROBE_SECONDS) -> bool:
    """Whether the Hub endpoint's host resolves and accepts a TCP connection within ``timeout`` seconds. Behind a
    proxy (``HTTPS_PROXY`` / ``ALL_PROXY``) the direct connection says nothing, so the Hub is assumed reachable."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(hub_endpoint())
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if not host:
        return True
    result = []

    def probe():  # in a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])
