"""Errors of the planner's inputs: a trace or profile file, or a Prometheus answer, it cannot use."""

from __future__ import annotations

from phalanx.common.errors import PhalanxError


class PlannerInputError(PhalanxError):
    """A trace, profile or set of samples the planner cannot use; the message names the file and what is wrong."""

    reason = "PLANNER_INPUT"


class TraceError(PlannerInputError):
    """A load trace that does not follow the format in predictors.py."""


class ProfileError(PlannerInputError):
    """A performance profile (.npz or samples) that does not follow the schema in profile.py."""


class PrometheusQueryError(PlannerInputError):
    """Prometheus answered a planner query with an error, or with something that is not an instant vector."""
