"""Dissolved: the failure policy is failure_policy (the action the judge's verdict carries), the
mass-disruption guard is disruption_guard. These names stay importable from here for the kopf
shell (handlers, __main__) until its imports name those modules."""

from .disruption_guard import DisruptionGuard, disruption, zone_health

__all__ = ["DisruptionGuard", "disruption", "zone_health"]
