"""The `phalanx` command's surface: its commands, and the options they share, declared once."""

from __future__ import annotations

import pytest
import typer.main

from phalanx.cli.main import app

pytestmark = pytest.mark.unit


def _commands(group) -> dict:
    context = type(group).context_class(group)
    return {name: group.get_command(context, name) for name in group.list_commands(context)}


ROOT = _commands(typer.main.get_command(app))


def test_the_bench_commands_are_a_sub_app_with_their_names():
    assert list(_commands(ROOT["bench"])) == [
        "engine", "route", "multimodal", "health", "channel", "serve", "moe", "failover", "chaos", "engine-failover", "planner", "soak",
        "goodput", "disagg",
    ]


SERVICES = ["worker", "expert-worker", "ert-manager", "router", "health", "checkpoint-store", "encoder-pool", "migration"]


@pytest.mark.parametrize("command", SERVICES)
def test_every_service_command_takes_the_shared_etcd_endpoint_and_log_level(command):
    params = {p.name: p for p in ROOT[command].params}
    assert params["etcd_endpoint"].opts == ["--etcd-endpoint"] and params["etcd_endpoint"].default is None
    assert "PHALANX_ETCD_ENDPOINT" in params["etcd_endpoint"].help and "host:port,host:port" in params["etcd_endpoint"].help
    assert params["log_level"].default == "INFO"


@pytest.mark.parametrize("command", ["generate", "chat", "status"])
def test_client_commands_find_their_router_the_same_way(command):
    params = {p.name: p for p in ROOT[command].params}
    assert (params["target"].envvar, params["api_key"].envvar, params["state_file"].envvar) == (
        "PHALANX_TARGET", "PHALANX_API_KEY", "PHALANX_STATE_FILE",
    )


def test_the_quarantine_commands_list_and_release_fingerprints_in_etcd():
    commands = _commands(ROOT["quarantine"])
    assert list(commands) == ["list", "release"]
    for command in commands.values():
        params = {p.name: p for p in command.params}
        assert params["etcd_endpoint"].opts == ["--etcd-endpoint"] and params["etcd_endpoint"].default is None
    release = {p.name: p for p in commands["release"].params}
    assert release["release_all"].opts == ["--all"] and release["fingerprints"].required is False
