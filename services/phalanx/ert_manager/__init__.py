"""The ERT manager: the elected process that keeps the expert routing table (`table`) in step with the expert workers.

The table itself is pure (`table.ExpertRoutingTable`, `table.ErtManager`); attention and expert workers read it too.
The process is `process.ErtManagerProcess` (`phalanx ert-manager`).
"""
