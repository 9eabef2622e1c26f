"""Exceptions of the mep SDK: one class per problem code of the daemon's API (RFC 9457
``application/problem+json``), a few grouping bases, and the SDK's own failures.

Every class derives from :class:`MepError`, which carries the problem's members
(``code``, ``status``, ``title``, ``detail``, ``instance``, ``type``), the
``Retry-After`` header as ``retry_after`` (seconds) and the problem's extension members
as the ``extensions`` dict; the well-known extensions (``reason``, ``codepoint``,
``index``, ``presented_token``, ``current_token``, ``unknown_fields``) are attributes
too, and any other extension can be read as an attribute.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple, Type

if TYPE_CHECKING:  # pragma: no cover
    from .types import Holder

__all__ = [
    "MepError",
    # grouping bases
    "Held",
    "LeaseGone",
    "TemporarilyUnavailable",
    "BadRequest",
    # one class per problem code
    "InvalidRequest",
    "IdempotencyKeyMissing",
    "IdempotencyKeyInvalid",
    "Unauthenticated",
    "Forbidden",
    "NotFound",
    "MemoryNotFound",
    "LeaseNotFound",
    "MethodNotAllowed",
    "MemoryIdTaken",
    "StaleFence",
    "IdempotencyRequestInFlight",
    "LeaseExpired",
    "PayloadTooLarge",
    "UnsupportedMediaType",
    "InvalidName",
    "InvalidTtl",
    "IdempotencyKeyReused",
    "NameHeld",
    "NameConfusable",
    "MemoryAttached",
    "RateLimited",
    "Internal",
    "StoreNotConfigured",
    "TransactionConflict",
    "Unavailable",
    "MigrationInProgress",
    "StoreUnavailable",
    "ControlPlaneUnreachable",
    "InsufficientStorage",
    # the SDK's own
    "DaemonNotRunning",
    "DaemonTimeout",
    "LeaseLost",
    "NotSupported",
    "ProtocolError",
    "ConfigError",
    "CliNotFound",
    "error_for_problem",
    "PROBLEM_CODES",
]

PROBLEM_TYPE_BASE = "https://memoryendpoints.com/problems/"

# Members of an RFC 9457 problem that are not extensions.
_STANDARD_MEMBERS = ("type", "title", "status", "detail", "instance", "code")

# Extensions that are always available as attributes (None when absent).
_WELL_KNOWN_EXTENSIONS = ("reason", "codepoint", "index", "presented_token", "current_token", "unknown_fields")


class MepError(Exception):
    """Base class of every error the SDK raises.

    For an error the daemon answered, the attributes are the problem's members; for one
    the SDK detected itself (say, the daemon is not running) they are filled in the same
    way, with the status the daemon would have used.
    """

    #: The problem code this class stands for (``None`` on grouping bases and SDK errors).
    CODE: Optional[str] = None
    #: The HTTP status that goes with :attr:`CODE`.
    STATUS: Optional[int] = None
    #: A title used when the daemon's answer has none.
    TITLE: str = "mep error"

    code: Optional[str]
    status: Optional[int]
    title: str
    detail: str
    instance: Optional[str]
    type: Optional[str]
    retry_after: Optional[float]
    extensions: Dict[str, Any]

    def __init__(
        self,
        detail: str = "",
        *,
        code: Optional[str] = None,
        status: Optional[int] = None,
        title: Optional[str] = None,
        instance: Optional[str] = None,
        type: Optional[str] = None,  # noqa: A002 - the RFC 9457 member's name
        retry_after: Optional[float] = None,
        extensions: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.code = code if code is not None else self.CODE
        self.status = status if status is not None else self.STATUS
        self.title = title if title else self.TITLE
        self.detail = detail
        self.instance = instance
        self.type = type if type is not None else (PROBLEM_TYPE_BASE + self.code if self.code else None)
        self.retry_after = retry_after
        self.extensions = dict(extensions or {})
        super().__init__(self.__str__())

    # Well-known extensions, as attributes.
    @property
    def reason(self) -> Optional[str]:
        """``reason`` extension: why a name is invalid (``mixed-script``, ...), or why a lease was lost."""
        v = self.extensions.get("reason")
        return v if isinstance(v, str) else None

    @property
    def codepoint(self) -> Optional[str]:
        """``codepoint`` extension of ``invalid-name`` (``"U+0021"``)."""
        v = self.extensions.get("codepoint")
        return v if isinstance(v, str) else None

    @property
    def index(self) -> Optional[int]:
        """``index`` extension of ``invalid-name``: where the disallowed code point is."""
        v = self.extensions.get("index")
        return v if isinstance(v, int) else None

    @property
    def presented_token(self) -> Optional[int]:
        """``presented_token`` extension of ``stale-fence``: the token that was refused."""
        v = self.extensions.get("presented_token")
        return v if isinstance(v, int) else None

    @property
    def current_token(self) -> Optional[int]:
        """``current_token`` extension of ``stale-fence``: the highest token the store has seen."""
        v = self.extensions.get("current_token")
        return v if isinstance(v, int) else None

    @property
    def unknown_fields(self) -> Optional[List[Any]]:
        """``unknown_fields`` extension of ``invalid-request``: fields the daemon does not know."""
        v = self.extensions.get("unknown_fields")
        return v if isinstance(v, list) else None

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: other extensions read as attributes.
        if name.startswith("__"):
            raise AttributeError(name)
        ext = self.__dict__.get("extensions", {})
        if name in ext:
            return ext[name]
        raise AttributeError("%s has no attribute or problem extension %r" % (type(self).__name__, name))

    def __str__(self) -> str:
        title = self.title or self.TITLE
        detail = self.detail or ""
        # "Invalid agent name: invalid agent name: ..." reads better without the repetition.
        if detail.lower().startswith(title.lower() + ":"):
            detail = detail[len(title) + 1 :].lstrip()
        return "%s: %s" % (title, detail) if detail else title

    def __repr__(self) -> str:
        return "%s(code=%r, status=%r, detail=%r)" % (type(self).__name__, self.code, self.status, self.detail)

    def to_problem(self) -> Dict[str, Any]:
        """The error as an RFC 9457 problem object (a dict ready for ``json.dumps``)."""
        out: Dict[str, Any] = {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "instance": self.instance,
            "code": self.code,
        }
        out.update(self.extensions)
        return {k: v for k, v in out.items() if v is not None}


# ---- grouping bases -------------------------------------------------------------------------


class BadRequest(MepError):
    """Grouping base of the 400 problems: the request itself was wrong (a bug in the caller or the SDK)."""

    TITLE = "Bad request"


class Held(MepError):
    """Grouping base of the three 423 problems: the name, a confusable name or the memory is
    held by a live lease. ``retry_after`` says how many seconds until that lease expires;
    :attr:`holder` who holds it, when the control plane tells (to a requester of the
    holder's tenant only)."""

    TITLE = "Held"

    @property
    def holder(self) -> "Optional[Holder]":
        """The problem's ``holder`` member as a :class:`mep.Holder` (display name, host,
        since, expires at), or None when the answer has none (another tenant's lease, an
        older daemon) or it cannot be read."""
        from .types import Holder as _Holder  # here: mep.types imports this module

        v = self.extensions.get("holder")
        if not isinstance(v, dict):
            return None
        try:
            return _Holder.from_json(v)
        except MepError:
            return None


class LeaseGone(MepError):
    """Grouping base of "this lease is no longer yours": ``stale-fence`` (a newer token
    exists), ``lease-expired`` and the SDK's own :class:`LeaseLost`."""

    TITLE = "Lease gone"


class TemporarilyUnavailable(MepError):
    """Grouping base of the 503 problems: try again later (see ``retry_after``)."""

    TITLE = "Temporarily unavailable"


# ---- one class per problem code -------------------------------------------------------------


class InvalidRequest(BadRequest):
    """400 ``invalid-request``: malformed JSON, wrong types, unknown fields, no such file."""

    CODE, STATUS, TITLE = "invalid-request", 400, "Invalid request"


class IdempotencyKeyMissing(BadRequest):
    """400 ``idempotency-key-missing`` (control plane): a creating POST without ``Idempotency-Key``."""

    CODE, STATUS, TITLE = "idempotency-key-missing", 400, "Idempotency-Key header missing"


class IdempotencyKeyInvalid(BadRequest):
    """400 ``idempotency-key-invalid`` (control plane): the ``Idempotency-Key`` is malformed."""

    CODE, STATUS, TITLE = "idempotency-key-invalid", 400, "Idempotency-Key header invalid"


class Unauthenticated(MepError):
    """401 ``unauthenticated``: the daemon's bearer token for the control plane was refused."""

    CODE, STATUS, TITLE = "unauthenticated", 401, "Authentication required"


class Forbidden(MepError):
    """403 ``forbidden``: this user may not use the daemon, or the token lacks a scope."""

    CODE, STATUS, TITLE = "forbidden", 403, "Forbidden"


class NotFound(MepError):
    """404 ``not-found``: no such endpoint (also the base of the other 404 problems)."""

    CODE, STATUS, TITLE = "not-found", 404, "Not found"


class MemoryNotFound(NotFound):
    """404 ``memory-not-found``: no such memory (for this tenant), or no stored object of it."""

    CODE, STATUS, TITLE = "memory-not-found", 404, "Memory not found"


class LeaseNotFound(NotFound):
    """404 ``lease-not-found``: the daemon holds no lease under that name."""

    CODE, STATUS, TITLE = "lease-not-found", 404, "Lease not found"


class MethodNotAllowed(BadRequest):
    """405 ``method-not-allowed``."""

    CODE, STATUS, TITLE = "method-not-allowed", 405, "Method not allowed"


class MemoryIdTaken(MepError):
    """409 ``memory-id-taken``: the memory id belongs to another tenant."""

    CODE, STATUS, TITLE = "memory-id-taken", 409, "Memory id taken"


class StaleFence(LeaseGone):
    """409 ``stale-fence``: the token was superseded (a newer lease on the memory exists).
    From a data plane, ``presented_token`` and ``current_token`` say which tokens."""

    CODE, STATUS, TITLE = "stale-fence", 409, "Fencing token superseded"


class IdempotencyRequestInFlight(MepError):
    """409 ``idempotency-request-in-flight``: the same request is still being answered."""

    CODE, STATUS, TITLE = "idempotency-request-in-flight", 409, "Request with this Idempotency-Key still in flight"


class LeaseExpired(LeaseGone):
    """410 ``lease-expired``: the lease expired (or the daemon already marked it lost)."""

    CODE, STATUS, TITLE = "lease-expired", 410, "Lease expired"


class PayloadTooLarge(BadRequest):
    """413 ``payload-too-large``."""

    CODE, STATUS, TITLE = "payload-too-large", 413, "Payload too large"


class UnsupportedMediaType(BadRequest):
    """415 ``unsupported-media-type``."""

    CODE, STATUS, TITLE = "unsupported-media-type", 415, "Unsupported media type"


class InvalidName(MepError):
    """422 ``invalid-name``: the agent name cannot be canonicalized. ``reason`` is one of
    ``empty``, ``too-long``, ``invalid-utf8``, ``disallowed-character`` (with ``codepoint``
    and ``index``), ``context-rule``, ``bidi-rule``, ``mixed-script``, ``mixed-numbers``,
    ``invisible-character``."""

    CODE, STATUS, TITLE = "invalid-name", 422, "Invalid agent name"


class InvalidTtl(MepError):
    """422 ``invalid-ttl``: ``ttl`` outside 5..300 seconds."""

    CODE, STATUS, TITLE = "invalid-ttl", 422, "Invalid TTL"


class IdempotencyKeyReused(MepError):
    """422 ``idempotency-key-reused``: the same key with another request body."""

    CODE, STATUS, TITLE = "idempotency-key-reused", 422, "Idempotency-Key reused with another request"


class NameHeld(Held):
    """423 ``name-held``: another owner holds a live lease on this canonical name."""

    CODE, STATUS, TITLE = "name-held", 423, "Name held"


class NameConfusable(Held):
    """423 ``name-confusable``: a live lease holds a name with the same UTS #39 skeleton
    (``раура`` in Cyrillic versus ``paypa``)."""

    CODE, STATUS, TITLE = "name-confusable", 423, "Confusable name held"


class MemoryAttached(Held):
    """423 ``memory-attached``: the memory file is attached to another live lease."""

    CODE, STATUS, TITLE = "memory-attached", 423, "Memory attached"


class RateLimited(MepError):
    """429 ``rate-limited``: see ``retry_after``."""

    CODE, STATUS, TITLE = "rate-limited", 429, "Rate limited"


class Internal(MepError):
    """500 ``internal``: a bug in the daemon or the control plane; ``instance`` is the request id."""

    CODE, STATUS, TITLE = "internal", 500, "Internal error"


class StoreNotConfigured(MepError):
    """501 ``store-not-configured``: mepd runs without ``--store``, so sync and fetch are off."""

    CODE, STATUS, TITLE = "store-not-configured", 501, "No data plane configured"


class TransactionConflict(TemporarilyUnavailable):
    """503 ``transaction-conflict``: the control plane's database kept conflicting; retry."""

    CODE, STATUS, TITLE = "transaction-conflict", 503, "Transaction conflict"


class Unavailable(TemporarilyUnavailable):
    """503 ``unavailable``: the control plane (or, as :class:`DaemonNotRunning`, the daemon)
    cannot be reached."""

    CODE, STATUS, TITLE = "unavailable", 503, "Service unavailable"


class ControlPlaneUnreachable(Unavailable):
    """503 ``control-plane-unreachable``: mepd could not reach its control plane (``mep
    server``), or its embedded one did not answer in time. A kind of :class:`Unavailable`
    (which it was before it had a code of its own); what was asked may have been done."""

    CODE, STATUS, TITLE = "control-plane-unreachable", 503, "Control plane unreachable"


class MigrationInProgress(TemporarilyUnavailable):
    """503 ``migration-in-progress``: lease endpoints are off until ``mep migrate activate``."""

    CODE, STATUS, TITLE = "migration-in-progress", 503, "Migration in progress"


class StoreUnavailable(TemporarilyUnavailable):
    """503 ``store-unavailable``: the data plane (``mep store``) could not be reached."""

    CODE, STATUS, TITLE = "store-unavailable", 503, "Data plane unavailable"


class InsufficientStorage(MepError):
    """507 ``insufficient-storage``: the data plane's disk is full."""

    CODE, STATUS, TITLE = "insufficient-storage", 507, "Insufficient storage"


# ---- the SDK's own --------------------------------------------------------------------------


class DaemonNotRunning(Unavailable):
    """The daemon's socket does not accept connections: mepd is not running there (or
    another socket path is configured). The message names the path and how it was found."""

    TITLE = "mepd is not running"


class DaemonTimeout(Unavailable):
    """The daemon accepted the request but did not answer in time."""

    TITLE = "No answer from mepd"


class LeaseLost(LeaseGone):
    """Raised by :meth:`mep.Lease.check` (and by the methods that call it) once the SDK
    considers the lease lost; ``reason`` says why (``deadline``, ``local-deadline``,
    ``released``, ``stale-fence``, ``max-hold``, ``revoked``, ...; ``closed`` once this
    process released it)."""

    CODE, STATUS, TITLE = "lease-lost", None, "Lease lost"


class NotSupported(MepError):
    """The running mepd predates a feature the SDK was asked to use (``POST /v1/verify``,
    ``/v1/sync``, ``/v1/fetch``, ``wait_seconds``); the original problem's members are kept."""

    TITLE = "Not supported by this mepd"


class ProtocolError(MepError):
    """The daemon's answer was not what the API promises (not HTTP, not JSON, ...)."""

    TITLE = "Protocol error"


class ConfigError(MepError):
    """The mep config file could not be read or parsed."""

    TITLE = "Configuration error"


class CliNotFound(MepError):
    """The ``mep`` CLI (needed by :func:`mep.canonicalize`) is not on ``$MEP_BIN`` or ``PATH``."""

    TITLE = "mep CLI not found"


def _all_code_classes() -> Dict[str, Type[MepError]]:
    out: Dict[str, Type[MepError]] = {}
    stack = list(MepError.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        code = cls.__dict__.get("CODE")
        if code and cls.STATUS is not None:
            out[code] = cls
    return out


#: code → exception class, for every problem code of the API.
PROBLEM_CODES: Dict[str, Type[MepError]] = _all_code_classes()


def _parse_retry_after(value: Optional[str]) -> Optional[float]:
    if not value:
        return None
    try:
        return float(value.strip())
    except ValueError:
        pass
    try:  # an HTTP-date
        import email.utils
        import time

        t = email.utils.parsedate_to_datetime(value)
        return max(0.0, t.timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _status_fallback(status: int) -> Tuple[Type[MepError], str]:
    table = {
        400: InvalidRequest, 401: Unauthenticated, 403: Forbidden, 404: NotFound, 405: MethodNotAllowed,
        410: LeaseExpired, 413: PayloadTooLarge, 415: UnsupportedMediaType, 429: RateLimited, 500: Internal,
        501: StoreNotConfigured, 503: Unavailable, 507: InsufficientStorage,
    }
    cls = table.get(status, MepError)
    return cls, "HTTP %d" % status


def error_for_problem(status: int, body: bytes, headers: Optional[Mapping[str, str]] = None) -> MepError:
    """The exception for one error answer: the class of its ``code`` (or a fallback by
    status when the body is not a problem), with every member and extension kept."""
    retry_after = _parse_retry_after((headers or {}).get("retry-after"))
    try:
        doc = json.loads(body.decode("utf-8")) if body else None
    except (UnicodeDecodeError, ValueError):
        doc = None
    if not isinstance(doc, dict):
        cls, detail = _status_fallback(status)
        text = body.decode("utf-8", "replace").strip()[:200] if body else ""
        return cls(text or detail, status=status, retry_after=retry_after)
    code = doc.get("code") if isinstance(doc.get("code"), str) else None
    found = PROBLEM_CODES.get(code or "")
    if found is not None:
        cls = found
    else:
        cls = _status_fallback(status)[0] if code is None else MepError
    extensions = {k: v for k, v in doc.items() if k not in _STANDARD_MEMBERS}
    return cls(
        str(doc.get("detail") or ""),
        code=code,
        status=doc.get("status") if isinstance(doc.get("status"), int) else status,
        title=str(doc.get("title") or "") or None,
        instance=doc.get("instance") if isinstance(doc.get("instance"), str) else None,
        type=doc.get("type") if isinstance(doc.get("type"), str) else None,
        retry_after=retry_after,
        extensions=extensions,
    )
