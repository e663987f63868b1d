"""The one error type the runtime raises, so a failing rank says which rank and group failed and why."""
from __future__ import annotations

from ..errors import JobError


class TrainingError(JobError):
    """A rank cannot continue: bad environment or plan, a peer died, a collective or RPC timed out."""
