"""Launchers and helpers for tests and for `phalanx up`: real nats-server and etcd processes."""
