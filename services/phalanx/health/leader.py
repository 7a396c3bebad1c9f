"""Leader election moved to `phalanx.common.leadership` (health, the planner and the ERT manager share it)."""

from phalanx.common.leadership import LeaderElection, LeadershipLostError, NotElectedError

__all__ = ["LeaderElection", "LeadershipLostError", "NotElectedError"]
