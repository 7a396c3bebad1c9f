"""Test helpers only (polling assertions, settings checks, state cleanup); production code never imports this package.

Launchers for nats-server, etcd and the services live in `phalanx.launch`.
"""
