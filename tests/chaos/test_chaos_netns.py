"""The veth-linked network namespace the worker-partition scenario cuts: real links, made and removed by the test."""

import socket
import subprocess
import sys

import pytest

from phalanx.chaos.netns import VethNamespace, unsupported_reason

pytestmark = pytest.mark.integration

REASON = unsupported_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _connects_from_inside(ns: VethNamespace, port: int) -> bool:
    code = f"import socket; socket.create_connection(({ns.root_address!r}, {port}), timeout=1.5).close()"
    done = subprocess.run([*ns.exec_prefix, sys.executable, "-c", code], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def _exists(ns: VethNamespace) -> tuple[bool, bool]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    link = subprocess.run(["ip", "link", "show", ns.root_interface], capture_output=True, check=False).returncode == 0
    return ns.namespace in namespaces, link


@needs_netns
def test_a_cut_link_stops_the_namespace_reaching_the_root_side_until_it_is_restored_and_close_removes_it():
    with VethNamespace() as ns, socket.create_server((ns.root_address, 0)) as server:
        port = server.getsockname()[1]
        assert _exists(ns) == (True, True)
        assert _connects_from_inside(ns, port)
        ns.cut()
        assert not _connects_from_inside(ns, port)
        # The root namespace still reaches its own services on the root side's address while the link is down.
        socket.create_connection((ns.root_address, port), timeout=1.5).close()
        ns.restore()
        assert _connects_from_inside(ns, port)
    assert _exists(ns) == (False, False)
    ns.close()  # idempotent


@needs_netns
def test_namespaces_made_side_by_side_get_their_own_names_and_subnets():
    with VethNamespace() as first, VethNamespace() as second:
        assert first.namespace != second.namespace and first.root_interface != second.root_interface
        assert {first.root_address, first.namespace_address}.isdisjoint({second.root_address, second.namespace_address})
        assert len(first.root_interface) <= 15
