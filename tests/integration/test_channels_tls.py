"""With mutual TLS on, a tensor channel's acceptor forms the group only with an opener that proved a service identity."""

import asyncio
import uuid

import pytest
import torch

from phalanx.common.channels import ChannelEndpoint, ChannelError
from phalanx.common.channels.rendezvous import check_claim, sign_claim
from phalanx.common.tls import ServiceTls, init_certs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs")
    init_certs(directory, ["worker", "checkpoint-store", "client"], days=1)
    init_certs(directory / "other-ca", ["worker"], days=1)
    return directory


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def test_a_service_opener_forms_the_channel_and_moves_tensors(certs):
    store = ServiceTls.from_dir(certs / "checkpoint-store")
    async with ChannelEndpoint(_name("store"), tls=store, timeout_s=10) as acceptor, \
            ChannelEndpoint(_name("worker"), tls=ServiceTls.from_dir(certs / "worker"), timeout_s=10) as opener:
        opened, accepted = await asyncio.gather(opener.open(acceptor.endpoint_id, "kv", address=acceptor.store_address), acceptor.accept("kv"))
        data, received = torch.randn(256), torch.empty(256)
        await asyncio.gather(opened.send(data), accepted.recv_into(received))
        assert torch.equal(received, data)
        await asyncio.gather(opened.close(), accepted.close())


@pytest.mark.parametrize(("opener_tls", "why"), [("client", "is not a Phalanx service"), (None, "presented no certificate")])
async def test_a_tenant_or_an_unauthenticated_opener_is_refused(certs, opener_tls, why):
    tls = ServiceTls.from_dir(certs / opener_tls) if opener_tls else None
    async with ChannelEndpoint(_name("store"), tls=ServiceTls.from_dir(certs / "checkpoint-store"), timeout_s=3) as acceptor, \
            ChannelEndpoint(_name("intruder"), tls=tls, timeout_s=3) as opener:
        opening = asyncio.ensure_future(opener.open(acceptor.endpoint_id, "kv", address=acceptor.store_address, timeout_s=3))
        with pytest.raises(ChannelError, match=why):
            await acceptor.accept("kv", timeout_s=3)
        with pytest.raises(ChannelError):
            await opening


def test_a_claim_from_another_ca_or_for_another_channel_is_refused(certs):
    acceptor = ServiceTls.from_dir(certs / "checkpoint-store")
    good = sign_claim(ServiceTls.from_dir(certs / "worker"), {"endpoint": "w0"}, "kv-1")
    assert check_claim(acceptor, good, "kv-1") == "worker"
    with pytest.raises(ChannelError, match="not signed"):
        check_claim(acceptor, good, "kv-2")
    with pytest.raises(ChannelError, match="not signed"):
        check_claim(acceptor, {**good, "endpoint": "w1"}, "kv-1")
    foreign = sign_claim(ServiceTls.from_dir(certs / "other-ca" / "worker"), {"endpoint": "w0"}, "kv-1")
    with pytest.raises(ChannelError, match="refused"):
        check_claim(acceptor, foreign, "kv-1")
    with pytest.raises(ChannelError, match="old"):
        check_claim(acceptor, {**good, "at": good["at"] - 3600}, "kv-1")
