"""Free TCP ports for process groups, servers and ``torch.distributed`` rendezvous in tests.

A port is handed out some seconds before the server or rendezvous that uses it binds it. Ports that
the kernel picks (``bind(("127.0.0.1", 0))``) come from its ephemeral range, the range that every
other ``bind(0)`` and outgoing connection draws from, including those of the engines under test and
of a second pytest-xdist worker: one of them could take the port in between. So the ports come from
below the ephemeral range instead, from a block of its own per pytest-xdist worker (workers never
hand out the same port), starting at a random offset (two test runs at once rarely meet), each
checked free by binding it, and never handed out twice by one process.
"""

from __future__ import annotations

import os
import random
import re
import socket

FIRST_PORT = 20000  # below Linux's default ephemeral range (32768-60999)
BLOCK = 768
BLOCKS = 16  # FIRST_PORT + BLOCKS * BLOCK = 32288
STRIDE = 7

_handed_out: set[int] = set()


def worker_index() -> int:
    """This pytest-xdist worker's number (``gw3`` -> 3); 0 outside xdist."""
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match[1]) if match else 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, from this worker's block (see the module)."""
    start = FIRST_PORT + (worker_index() % BLOCKS) * BLOCK
    offset = random.randrange(BLOCK)
    for i in range(BLOCK):  # coprime to BLOCK: every port once; a server's port + 1 is not next
        port = start + (offset + STRIDE * i) % BLOCK
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {start}-{start + BLOCK - 1} on 127.0.0.1")
