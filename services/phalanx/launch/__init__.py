"""Launchers for real processes: nats-server, etcd and Phalanx services, each a child stopped by its PID.

`phalanx up`, the benchmarks and the tests all start processes through these modules.
"""
