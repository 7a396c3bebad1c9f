"""EtcdConfig with several etcd members, and the gRPC target the client dials for them."""

import pytest
from pydantic import ValidationError

from phalanx.common.config import EtcdConfig
from phalanx.common.lease import etcd_target

pytestmark = pytest.mark.unit


def test_one_endpoint_is_dialled_as_given():
    config = EtcdConfig(endpoint="etcd.example:2379")
    assert config.endpoints == [("etcd.example", 2379)]
    assert (config.host, config.port) == ("etcd.example", 2379)
    assert etcd_target(config) == "etcd.example:2379"


def test_an_ipv6_endpoint_keeps_its_brackets_in_the_target():
    assert etcd_target(EtcdConfig(endpoint="[::1]:2379")) == "[::1]:2379"


def test_every_member_of_a_cluster_is_in_one_static_target():
    config = EtcdConfig(endpoint="127.0.0.1:2379, 127.0.0.2:2380,127.0.0.3:2381")
    assert config.endpoints == [("127.0.0.1", 2379), ("127.0.0.2", 2380), ("127.0.0.3", 2381)]
    assert etcd_target(config) == "ipv4:127.0.0.1:2379,127.0.0.2:2380,127.0.0.3:2381"


def test_an_ipv6_cluster_gets_an_ipv6_target():
    assert etcd_target(EtcdConfig(endpoint="[::1]:1,[::2]:2")) == "ipv6:[::1]:1,[::2]:2"


def test_member_names_are_resolved_to_addresses_for_the_static_target():
    target = etcd_target(EtcdConfig(endpoint="localhost:2379,127.0.0.9:2379"))
    assert target == "ipv4:127.0.0.1:2379,127.0.0.9:2379"


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "127.0.0.1:2379,", "127.0.0.1:2379,etcd", "a:1,b:70000"])
def test_a_malformed_member_list_is_refused(endpoint):
    with pytest.raises(ValidationError, match="host:port"):
        EtcdConfig(endpoint=endpoint)
