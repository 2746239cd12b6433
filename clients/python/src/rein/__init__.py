"""Rein for Python: a client of the Rein API (`Client`, `AsyncClient`) and an SDK for
writing the nodes of an `http`-action definition (`rein.node`)."""

from . import errors, models, node, sse
from .client import AsyncClient, Client
from .errors import (
    Conflict,
    EventNotAllowed,
    Fenced,
    Forbidden,
    InvalidTransition,
    NotFound,
    QuotaExceeded,
    ReinError,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    WaitTimeout,
)
from .models import (
    ApprovalView as Approval,
    DecisionView as Decision,
    EventView as Event,
    RunView as Run,
    WhyView as Diagnosis,
    WorkerView as Worker,
)
from .sse import Committed, Delta, End, StreamItem

__version__ = "0.1.0"

__all__ = [
    "Approval",
    "AsyncClient",
    "Client",
    "Committed",
    "Conflict",
    "Decision",
    "Delta",
    "Diagnosis",
    "End",
    "Event",
    "EventNotAllowed",
    "Fenced",
    "Forbidden",
    "InvalidTransition",
    "NotFound",
    "QuotaExceeded",
    "ReinError",
    "Run",
    "StreamItem",
    "Unauthorized",
    "Unavailable",
    "ValidationFailed",
    "WaitTimeout",
    "Worker",
    "errors",
    "models",
    "node",
    "sse",
]
