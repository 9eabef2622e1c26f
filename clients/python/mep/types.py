"""The daemon's answers as typed, immutable values. Every value keeps the JSON object it
was made from in ``raw``, so fields a newer daemon adds are not lost."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from .errors import ProtocolError

__all__ = [
    "LeaseInfo",
    "Event",
    "MemoryIdentity",
    "BranchResult",
    "Lineage",
    "CanonicalName",
    "VerifyResult",
    "SyncResult",
    "FetchResult",
    "Health",
    "Holder",
    "parse_time",
]


def parse_time(value: Any) -> Optional[datetime.datetime]:
    """An RFC 3339 UTC timestamp (``2026-07-14T19:12:50.123Z``) as an aware datetime; None for None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError("expected an RFC 3339 timestamp, got %r" % (value,))
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ProtocolError("not an RFC 3339 timestamp: %r" % value) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t


def _s(o: Mapping[str, Any], k: str) -> str:
    v = o.get(k)
    if not isinstance(v, str):
        raise ProtocolError("the daemon's answer lacks the string %r: %r" % (k, dict(o)))
    return v


def _os(o: Mapping[str, Any], k: str) -> Optional[str]:
    v = o.get(k)
    return v if isinstance(v, str) else None


def _oi(o: Mapping[str, Any], k: str) -> Optional[int]:
    v = o.get(k)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class LeaseInfo:
    """One lease as the daemon reports it (``POST /v1/attach``, ``GET /v1/leases``).
    ``fencing_token`` is None once the lease is ``lost``; ``state`` is ``held``,
    ``degraded`` or ``lost``."""

    lease_id: str
    canonical_name: str
    display_name: str
    memory_instance_id: str
    fencing_token: Optional[int]
    expires_at: Optional[datetime.datetime]
    ttl_seconds: Optional[int]
    path: str
    state: str
    bind_pid: Optional[int]
    lost_reason: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "LeaseInfo":
        """Build from the daemon's JSON lease object."""
        return cls(
            lease_id=_s(o, "lease_id"),
            canonical_name=_s(o, "canonical_name"),
            display_name=_os(o, "display_name") or _s(o, "canonical_name"),
            memory_instance_id=_s(o, "memory_instance_id"),
            fencing_token=_oi(o, "fencing_token"),
            expires_at=parse_time(o.get("expires_at")),
            ttl_seconds=_oi(o, "ttl_seconds"),
            path=_os(o, "path") or "",
            state=_os(o, "state") or "held",
            bind_pid=_oi(o, "bind_pid"),
            lost_reason=_os(o, "lost_reason"),
            raw=dict(o),
        )


@dataclass(frozen=True)
class Holder:
    """Who holds a name or memory, as a refused claim (423: :class:`~mep.NameHeld`,
    :class:`~mep.NameConfusable`, :class:`~mep.MemoryAttached`) tells a requester of the
    holder's tenant (see :attr:`mep.Held.holder`): the holder's display name, its host
    (None when not known: a daemon run with ``--anonymous-holder``), since when it holds
    the lease (its first grant) and when the lease expires unless renewed. Never the
    lease's id, owner or token."""

    display_name: str
    host: Optional[str]
    since: datetime.datetime
    expires_at: datetime.datetime
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "Holder":
        """Build from the problem's ``holder`` member (:class:`~mep.ProtocolError` if it is not one)."""
        since = parse_time(o.get("since"))
        expires_at = parse_time(o.get("expires_at"))
        if since is None or expires_at is None:
            raise ProtocolError("the holder lacks since or expires_at: %r" % (dict(o),))
        return cls(
            display_name=_s(o, "display_name"),
            host=_os(o, "host") or None,
            since=since,
            expires_at=expires_at,
            raw=dict(o),
        )


@dataclass(frozen=True)
class Event:
    """One line of ``GET /v1/events``: ``event`` is ``granted``, ``renewed``, ``degraded``,
    ``lost`` or ``released``. ``fencing_token`` and ``expires_at`` come with granted,
    renewed and degraded; ``reason`` with degraded and lost (``deadline``, ``stale-fence``,
    ``lease-expired``, ``max-hold``: the lease reached its ``max_hold``, ``revoked``: an
    operator ran ``mep lease revoke``, ...); ``lease_id`` from daemons that send it."""

    event: str
    canonical_name: str
    memory_instance_id: str
    state: str
    at: Optional[datetime.datetime]
    fencing_token: Optional[int] = None
    expires_at: Optional[datetime.datetime] = None
    reason: Optional[str] = None
    lease_id: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "Event":
        """Build from one decoded NDJSON line."""
        return cls(
            event=_os(o, "event") or "",
            canonical_name=_os(o, "canonical_name") or "",
            memory_instance_id=_os(o, "memory_instance_id") or "",
            state=_os(o, "state") or "",
            at=parse_time(o.get("at")),
            fencing_token=_oi(o, "fencing_token"),
            expires_at=parse_time(o.get("expires_at")),
            reason=_os(o, "reason"),
            lease_id=_os(o, "lease_id"),
            raw=dict(o),
        )


@dataclass(frozen=True)
class MemoryIdentity:
    """A memory file's identity (``GET /v1/identify``, ``POST /v1/init``). A memory made by
    ``init`` has no parent; one made by ``branch`` records its parent and the parent's
    fencing token at branch time."""

    memory_instance_id: str
    path: str
    parent_memory_instance_id: Optional[str] = None
    branched_at_token: Optional[int] = None
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "MemoryIdentity":
        """Build from the daemon's JSON."""
        return cls(
            memory_instance_id=_s(o, "memory_instance_id"),
            path=_os(o, "path") or "",
            parent_memory_instance_id=_os(o, "parent_memory_instance_id"),
            branched_at_token=_oi(o, "branched_at_token"),
            raw=dict(o),
        )


@dataclass(frozen=True)
class BranchResult:
    """The new memory made by ``POST /v1/branch``."""

    memory_instance_id: str
    parent_memory_instance_id: str
    branched_at_token: int
    path: str
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "BranchResult":
        """Build from the daemon's JSON."""
        return cls(
            memory_instance_id=_s(o, "memory_instance_id"),
            parent_memory_instance_id=_s(o, "parent_memory_instance_id"),
            branched_at_token=_oi(o, "branched_at_token") or 0,
            path=_os(o, "path") or "",
            raw=dict(o),
        )


@dataclass(frozen=True)
class Lineage:
    """``GET /v1/lineage``: the memory, its ancestors up to the root (nearest first) and its
    direct children, each a control-plane memory object (``memory_instance_id``,
    ``parent_memory_instance_id``, ``branched_at_token``, ``created_at``,
    ``fencing_token_high_water``)."""

    memory_instance_id: str
    memory: Dict[str, Any]
    ancestors: List[Dict[str, Any]]
    children: List[Dict[str, Any]]
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "Lineage":
        """Build from the daemon's JSON."""
        mem = o.get("memory")
        anc = o.get("ancestors")
        ch = o.get("children")
        return cls(
            memory_instance_id=_s(o, "memory_instance_id"),
            memory=dict(mem) if isinstance(mem, dict) else {},
            ancestors=[dict(a) for a in anc if isinstance(a, dict)] if isinstance(anc, list) else [],
            children=[dict(c) for c in ch if isinstance(c, dict)] if isinstance(ch, list) else [],
            raw=dict(o),
        )


@dataclass(frozen=True)
class CanonicalName:
    """What ``mep canonicalize --json`` says about a valid name: the ``input`` as given, the
    ``canonical_name`` (what the API returns and users see), the UTS #39 ``skeleton``
    (uniqueness among live leases is on it) and the ``scripts`` of the name."""

    input: str
    canonical_name: str
    skeleton: str
    scripts: List[str]
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class VerifyResult:
    """``POST /v1/verify``: the control plane confirmed this token is the memory's current one."""

    canonical_name: str
    memory_instance_id: str
    fencing_token: int
    expires_at: Optional[datetime.datetime]
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "VerifyResult":
        """Build from the daemon's JSON."""
        return cls(
            canonical_name=_s(o, "canonical_name"),
            memory_instance_id=_s(o, "memory_instance_id"),
            fencing_token=_oi(o, "fencing_token") or 0,
            expires_at=parse_time(o.get("expires_at")),
            raw=dict(o),
        )


@dataclass(frozen=True)
class SyncResult:
    """``POST /v1/sync``: the file's bytes were stored under this fencing token."""

    canonical_name: str
    memory_instance_id: str
    fencing_token: int
    etag: Optional[str]
    size: Optional[int]
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "SyncResult":
        """Build from the daemon's JSON."""
        return cls(
            canonical_name=_s(o, "canonical_name"),
            memory_instance_id=_s(o, "memory_instance_id"),
            fencing_token=_oi(o, "fencing_token") or 0,
            etag=_os(o, "etag"),
            size=_oi(o, "size"),
            raw=dict(o),
        )


@dataclass(frozen=True)
class FetchResult:
    """``POST /v1/fetch``: the memory's latest stored object, written to a new file bound to
    the memory's identity; ``fencing_token`` is the token it was written with."""

    memory_instance_id: str
    path: str
    fencing_token: Optional[int]
    etag: Optional[str]
    size: Optional[int]
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "FetchResult":
        """Build from the daemon's JSON."""
        return cls(
            memory_instance_id=_s(o, "memory_instance_id"),
            path=_os(o, "path") or "",
            fencing_token=_oi(o, "fencing_token"),
            etag=_os(o, "etag"),
            size=_oi(o, "size"),
            raw=dict(o),
        )


@dataclass(frozen=True)
class Health:
    """``GET /healthz``: the daemon's id, its control plane and how many leases it keeps."""

    status: str
    daemon_id: Optional[str]
    control_plane: Optional[str]
    leases: Optional[int]
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> "Health":
        """Build from the daemon's JSON."""
        return cls(
            status=_os(o, "status") or "",
            daemon_id=_os(o, "daemon_id"),
            control_plane=_os(o, "control_plane"),
            leases=_oi(o, "leases"),
            raw=dict(o),
        )
