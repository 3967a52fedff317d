"""The one error type the compiler raises for a bad plan, model or mesh."""

from dtmega.kernels.errors import DtmegaError


class PlanError(DtmegaError):
    """A plan cannot run as written. The message names the problem and the fix.

    Raised while annotating and validating, before any parameter is materialized or any
    collective runs, from facts every rank shares (model shapes, plan, mesh sizes), so every
    rank raises the same message instead of hanging in a collective.
    """
