"""A network namespace joined to the root one by a veth pair: a real link that a chaos scenario cuts and restores.

The root side of the pair gets ``10.213.<a>.<b+1>/30`` and the namespace side ``<b+2>``; the /30 is picked from the
run's PID (then the next free one), and the names carry the PID too, so that runs side by side do not clash.
Services in the root namespace that the namespaced process must reach listen on ``root_address``: the kernel keeps
delivering to that local address while the link is down, so the root namespace never loses them, while the namespace
loses everything. ``cut()`` sets the root side down (the namespace side loses its carrier; nothing crosses either
way, and both ends' sockets stay open, as with a pulled cable); ``restore()`` sets it up again.

Everything goes through the ``ip`` command (iproute2), which needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN);
``unsupported_reason()`` says why it cannot run here, for callers that skip.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import os
import shutil
import subprocess
from typing import Self

__all__ = ["NetnsError", "VethNamespace", "unsupported_reason"]

log = logging.getLogger(__name__)

# The /16 the pairs take their /30s from (private, and unlikely to be routed on a test box).
_NETWORK = ipaddress.IPv4Network("10.213.0.0/16")
_SUBNETS = _NETWORK.num_addresses // 4
_IP_TIMEOUT_S = 10.0
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def unsupported_reason() -> str | None:
    """Why network namespaces cannot be made here (no ``ip``, not root, or the kernel refuses one); None if they can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "ip netns needs root"
    probe = f"phalanx-probe-{os.getpid()}-{next(_counter)}"
    try:
        done = _ip("netns", "add", probe, check=False)
        if done.returncode != 0:
            return f"ip netns add is not permitted: {done.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _addresses_in_use() -> set[ipaddress.IPv4Address]:
    done = _ip("-o", "-4", "addr", "show")
    found = set()
    for line in done.stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            found.add(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).ip)
    return found


class VethNamespace:
    """One namespace with one veth pair to the root namespace; ``close()`` (or leaving the ``with``) removes both."""

    def __init__(self) -> None:
        tag = f"{os.getpid():x}{next(_counter)}"
        self.namespace = f"phalanx-{tag}"
        # Interface names have at most 15 characters: "phx" + PID in hex (<= 6) + counter + side.
        self.root_interface = f"phx{tag}r"
        self.namespace_interface = f"phx{tag}n"
        in_use = _addresses_in_use()
        start = os.getpid() % _SUBNETS
        for offset in range(_SUBNETS):
            subnet = _NETWORK.network_address + 4 * ((start + offset) % _SUBNETS)
            if subnet + 1 not in in_use and subnet + 2 not in in_use:
                break
        else:
            raise NetnsError(f"no free /30 left in {_NETWORK}")
        self.root_address = str(subnet + 1)
        self.namespace_address = str(subnet + 2)
        self._made = False

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """What runs a command inside the namespace (``ip netns exec`` execs it: the PID stays the command's)."""
        return ("ip", "netns", "exec", self.namespace)

    def create(self) -> Self:
        """The namespace, the pair, the addresses, every interface up; on failure whatever was made is removed."""
        self._made = True
        try:
            _ip("netns", "add", self.namespace)
            _ip("link", "add", self.root_interface, "type", "veth", "peer", "name", self.namespace_interface)
            _ip("link", "set", self.namespace_interface, "netns", self.namespace)
            _ip("addr", "add", f"{self.root_address}/30", "dev", self.root_interface)
            _ip("link", "set", self.root_interface, "up")
            inside = ("netns", "exec", self.namespace, "ip")
            _ip(*inside, "addr", "add", f"{self.namespace_address}/30", "dev", self.namespace_interface)
            _ip(*inside, "link", "set", self.namespace_interface, "up")
            _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def cut(self) -> None:
        """The link down: nothing crosses it; processes and their sockets on both sides stay."""
        _ip("link", "set", self.root_interface, "down")

    def restore(self) -> None:
        """The link up again (the kernel puts the /30's route back)."""
        _ip("link", "set", self.root_interface, "up")

    def close(self) -> None:
        """Remove the pair (deleting one end deletes both) and the namespace; idempotent, never raises."""
        if not self._made:
            return
        self._made = False
        for args in (("link", "del", self.root_interface), ("netns", "del", self.namespace)):
            with contextlib.suppress(Exception):
                done = _ip(*args, check=False)
                if done.returncode != 0 and "Cannot find" not in done.stderr and "No such" not in done.stderr:
                    log.warning("ip %s: %s", " ".join(args), done.stderr.strip())

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
