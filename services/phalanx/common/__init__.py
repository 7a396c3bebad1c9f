"""Shared building blocks of every Phalanx service: config, names, telemetry, NATS, etcd."""
