"""Network hosts on this machine for multi-node tests: each a network namespace with its own address,
linked to this (the main) namespace by a veth pair, so traffic between them crosses a real link.

`network_host(name)` yields a `Host`: `ip` is the host's address, `peer` this namespace's address on the
same link, `dev`/`peer_dev` the two ends' interface names (for GLOO_SOCKET_IFNAME), `run(cmd)` the command
run inside it. Needs root and iproute2; `CAN_MAKE_HOSTS` / `WHY_NOT` say whether this machine can.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CAN_MAKE_HOSTS = os.geteuid() == 0 and shutil.which("ip") is not None
WHY_NOT = "needs root and iproute2 (ip netns) to make network hosts"
_links = itertools.count(1)


@dataclass(frozen=True)
class Host:
    netns: str
    ip: str
    peer: str
    dev: str
    peer_dev: str

    def run(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def network_host(name: str) -> Iterator[Host]:
    """A host `10.<79+n>.<10+pid%200>.2` on its own /24 link, this namespace at `.1`; removed afterwards."""
    n, pid = next(_links), os.getpid()
    subnet = f"10.{79 + n}.{10 + pid % 200}"
    host = Host(f"arl-{name}-{pid}", f"{subnet}.2", f"{subnet}.1", f"arl{n}h{pid % 10000}", f"arl{n}p{pid % 10000}")
    ip("netns", "add", host.netns)
    try:
        ip("link", "add", host.peer_dev, "type", "veth", "peer", "name", host.dev)
        ip("link", "set", host.dev, "netns", host.netns)
        ip("addr", "add", f"{host.peer}/24", "dev", host.peer_dev)
        ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", host.dev)
        ip("link", "set", host.peer_dev, "up")
        ip("-n", host.netns, "link", "set", host.dev, "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        yield host
    finally:
        subprocess.run(["ip", "link", "del", host.peer_dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
