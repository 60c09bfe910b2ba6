"""The one exception tree of muster.

Every error muster raises on purpose is a ``MusterError``. The branch says whose move it is:

    MusterError
    ├── UserError                 the input is wrong; the user fixes it (CLI exit 2, HTTP 4xx)
    │   ├── SpecError             a job spec or file failed validation (HTTP 422); lists FieldErrors
    │   ├── BadRequest            a request that is well formed but not allowed now (HTTP 400/409)
    │   ├── NotFound              a job, worker or artifact that does not exist (HTTP 404)
    │   ├── Unauthorized          no credential, or one the controller does not know (HTTP 401)
    │   ├── Forbidden             a known credential without the right to this call (HTTP 403)
    │   └── TooLarge              an upload over the controller's size limit (HTTP 413)
    ├── PlatformError             muster refused or lost a decision (CLI exit 3, HTTP 409/503)
    │   ├── PlacementConflict     a reservation lost a race for a worker; the pass is retried
    │   ├── IllegalTransition     a lifecycle move the state table forbids
    │   └── CohortDiverged        ranks of a training cohort reached a round out of step
    ├── InfrastructureError       something below muster failed (CLI exit 4, HTTP 502/503)
    │   └── StoreUnavailable      the database cannot be opened or migrated
    └── JobFailed                 the job ran and ended failed or cancelled (``muster.launch``
                                  raises it, carrying the job's result)

Lower-level exceptions (SQLAlchemy, OSError, pydantic) are caught at the seam that
causes them and re-raised as one of these, with a message that names the thing and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass


class MusterError(Exception):
    """Root of every error muster raises on purpose."""

    exit_code = 1
    http_status = 500


class UserError(MusterError):
    """The input is wrong; the message says which field and how to fix it."""

    exit_code = 2
    http_status = 400


@dataclass(frozen=True)
class FieldError:
    """One refusal: the dotted path of the field, what is wrong, and the fix."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class SpecError(UserError):
    """A job spec, cluster file or inventory failed validation; nothing was stored."""

    http_status = 422

    def __init__(self, errors: list[FieldError], source: str = "job spec") -> None:
        self.errors = list(errors)
        self.source = source
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{source} is invalid ({len(self.errors)} error(s)):\n{lines}")

    @property
    def fields(self) -> list[str]:
        return [e.field for e in self.errors]


class BadRequest(UserError):
    """Well formed, but not allowed in the current state."""

    http_status = 409


class NotFound(UserError):
    """The named job, worker or artifact does not exist."""

    http_status = 404


class Unauthorized(UserError):
    """The call carries no credential, or one the controller does not know."""

    http_status = 401


class Forbidden(UserError):
    """The credential is known but does not give the right to this call."""

    http_status = 403


class TooLarge(UserError):
    """An upload is over the controller's limit; the message names the limit and its flag."""

    http_status = 413


class PlatformError(MusterError):
    """muster refused or lost a decision; retrying later may succeed."""

    exit_code = 3
    http_status = 409


class PlacementConflict(PlatformError):
    """A reservation found a worker already taken; the scheduler pass runs again."""


class IllegalTransition(PlatformError):
    """A lifecycle move that the state's transition table forbids."""


class CohortDiverged(PlatformError):
    """Ranks reached an averaging round at different windows: their collectives no longer pair."""


class CohortStopped(PlatformError):
    """The training cohort stopped with a save (a reduce stalled, a rank asked): each rank
    wrote its checkpoint and the reason; resume from it."""


class CohortLost(PlatformError):
    """This rank is out of the training cohort: its peers or its link to them are gone (the
    star could not form, the root died, the cohort declared this rank dead)."""


class InfrastructureError(MusterError):
    """Something below muster failed: the database, a host, the network."""

    exit_code = 4
    http_status = 503


class StoreUnavailable(InfrastructureError):
    """The database cannot be opened, reached or migrated."""


class JobFailed(MusterError):
    """The job ended failed or cancelled; ``result`` holds what it did (state, root cause,
    per-rank exit codes, artifacts: a ``muster.client.JobResult``)."""

    exit_code = 1

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result
