"""Rendezvous ports for the tests' distributed launches.

Binding port 0 and closing the socket gives a port that is free at that moment, but the launch
binds it seconds later (Python and accelerate start first), and meanwhile the kernel may hand
the same port to another socket: every outgoing TCP connection and every ``bind(0)`` draws
from the ephemeral range, and under ``make test`` the other pytest worker's gloo processes open
many. A launch that loses that race exits with "address already in use".

:func:`launch_port` therefore picks from below the ephemeral range, which the kernel never
hands out on its own, in a slice of its own for each xdist worker (two workers never pick the
same port), and checks that nothing listens there.
"""

from __future__ import annotations

import os
import random
import socket

_SLICE = 2000  # ports per xdist worker


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def launch_port() -> int:
    """A free TCP port on 127.0.0.1 outside the ephemeral range, this worker's own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    top = min(_ephemeral_low(), 65536)
    low = max(1024, top - _SLICE * (index + 1))
    high = max(low + 1, top - _SLICE * index)
    draw = random.Random()  # its own generator: tests that seed the global one get fresh ports too
    for port in draw.sample(range(low, high), min(200, high - low)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken, or in TIME_WAIT from an earlier launch
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high - 1}")
