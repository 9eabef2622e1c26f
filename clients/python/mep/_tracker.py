"""How the SDK decides that a lease is at risk or lost: a state machine without I/O,
shared by the threaded (:mod:`mep.lease`) and the asyncio (:mod:`mep.aio`) leases.

Design notes (mirrors ``mep run``, cli/cmd_run.cpp):

* The event stream is opened *before* the attach is sent. Until the attach answers, the
  tracker only buffers events (:meth:`LossTracker.event`); :meth:`LossTracker.attached`
  replays them once the lease's name and token are known.
* Events of the lease's canonical name that come before its own ``granted`` (the one with
  its fencing token) belong to an earlier holder of the name on this daemon and are ignored.
  Where the daemon puts ``lease_id`` in its events, they are matched on it instead.
* Local deadline (monotonic clock): time the attach was *sent* + ttl − margin, where
  margin = max(1 s, 10 % of ttl); on each ``renewed`` event: time heard + ttl − 2·margin
  (the renewal was sent a little before it was heard of, so twice the daemon's margin, as
  ``mep run`` keeps). :meth:`LossTracker.tick` declares the lease lost
  (``local-deadline``) once the deadline passes with no renewal heard — the SDK does not
  wait to be told.
* at risk: a ``degraded`` event (the daemon's renewals are failing), or the event stream
  has ended (the daemon restarted or died: nothing can be heard). Cleared by ``renewed``,
  or by a re-check that finds the lease ``held``. A lost lease is also at risk.
* lost: a ``lost`` event, a ``released`` event while the lease is in use (someone ran
  ``mep release``), a ``granted`` of the name with another token, the local deadline,
  a re-check after the stream came back (:meth:`LossTracker.recheck`) that does not find
  this lease (same lease id and token, not lost), or an answer the caller got
  (:meth:`LossTracker.lose`: ``stale-fence``, ``lease-expired`` from verify or sync).
  Loss is final.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Tuple

from .types import Event, LeaseInfo

#: Reasons the SDK itself gives (the daemon's ``lost`` events bring their own, e.g. ``deadline``).
REASON_LOCAL_DEADLINE = "local-deadline"
REASON_RELEASED = "released"
REASON_SUPERSEDED = "superseded"
REASON_NOT_HELD = "not-held"
AT_RISK_DEGRADED = "degraded"
AT_RISK_DAEMON_UNREACHABLE = "daemon-unreachable"


def margin_seconds(ttl: float) -> float:
    """The safety margin of a ttl: max(1 s, 10 % of ttl), as the daemon and ``mep run`` use."""
    return max(1.0, 0.1 * ttl)


class LossTracker:
    """The at-risk / lost state of one lease. Not thread-safe: the owner serializes calls."""

    def __init__(self, ttl_hint: float = 30.0) -> None:
        self.canonical_name: Optional[str] = None
        self.memory_instance_id: Optional[str] = None
        self.lease_id: Optional[str] = None
        self.token: Optional[int] = None
        self.ttl: float = float(ttl_hint)
        self.deadline: Optional[float] = None
        self.expires_at: Optional[datetime.datetime] = None
        self.granted_seen = False
        self.closing = False
        self.need_recheck = False
        self.lost_reason: Optional[str] = None
        self.at_risk_reason: Optional[str] = None
        self._early: List[Tuple[Event, float]] = []

    # ---- state -------------------------------------------------------------------------
    @property
    def lost(self) -> bool:
        """Whether the lease is considered lost (final)."""
        return self.lost_reason is not None

    @property
    def at_risk(self) -> bool:
        """Whether the lease is at risk (degraded, daemon unreachable, or lost)."""
        return self.at_risk_reason is not None

    @property
    def is_attached(self) -> bool:
        """Whether the attach has answered (name and token known)."""
        return self.canonical_name is not None

    def seconds_to_deadline(self, now: float) -> Optional[float]:
        """Seconds until the local deadline (negative once passed); None before the attach."""
        return None if self.deadline is None else self.deadline - now

    # ---- inputs ------------------------------------------------------------------------
    def attached(self, info: LeaseInfo, sent_at: float) -> None:
        """The attach answered 201 with ``info``; ``sent_at`` is when it was sent (monotonic)."""
        self.canonical_name = info.canonical_name
        self.memory_instance_id = info.memory_instance_id
        self.lease_id = info.lease_id
        self.token = info.fencing_token
        if info.ttl_seconds:
            self.ttl = float(info.ttl_seconds)
        self.deadline = sent_at + self.ttl - margin_seconds(self.ttl)
        self.expires_at = info.expires_at
        early, self._early = self._early, []
        for ev, when in early:
            self._apply(ev, when)

    def event(self, ev: Event, now: float) -> None:
        """One event from the stream, heard at ``now`` (monotonic)."""
        if not self.is_attached:
            self._early.append((ev, now))
            if len(self._early) > 10000:  # a busy daemon and a slow attach: keep the newest
                del self._early[:5000]
            return
        self._apply(ev, now)

    def _apply(self, ev: Event, now: float) -> None:
        if self.lost or self.closing or ev.canonical_name != self.canonical_name:
            return
        if ev.lease_id is not None and self.lease_id is not None:
            # A daemon that names the lease in its events: attribution is exact.
            if ev.lease_id != self.lease_id:
                if ev.event == "granted" and self.granted_seen:
                    self.lose(REASON_SUPERSEDED)
                return
            self.granted_seen = True
            if ev.event == "granted":
                return
        elif ev.event == "granted":
            if ev.fencing_token is not None and ev.fencing_token == self.token:
                self.granted_seen = True
            elif self.granted_seen and ev.fencing_token is not None:
                self.lose(REASON_SUPERSEDED)
            return
        if not self.granted_seen:
            return  # an earlier holder of the name on this daemon
        if ev.fencing_token is not None and self.token is not None and ev.fencing_token != self.token:
            return
        if ev.event == "renewed":
            self.deadline = now + self.ttl - 2 * margin_seconds(self.ttl)
            if ev.expires_at is not None:
                self.expires_at = ev.expires_at
            if self.at_risk_reason is not None and not self.need_recheck:
                self.at_risk_reason = None
        elif ev.event == "degraded":
            if ev.expires_at is not None:
                self.expires_at = ev.expires_at
            self.at_risk_reason = AT_RISK_DEGRADED + (" (%s)" % ev.reason if ev.reason else "")
        elif ev.event == "lost":
            self.lose(ev.reason or "lost")
        elif ev.event == "released":
            self.lose(REASON_RELEASED)

    def tick(self, now: float) -> None:
        """Time passes: past the local deadline with no renewal heard, the lease is lost."""
        if self.lost or self.closing or self.deadline is None:
            return
        if now >= self.deadline:
            self.lose(REASON_LOCAL_DEADLINE)

    def stream_down(self) -> None:
        """The event stream ended: at risk until a re-check says otherwise."""
        self.need_recheck = True
        if not self.lost and not self.closing:
            self.at_risk_reason = AT_RISK_DAEMON_UNREACHABLE

    def recheck(self, info: Optional[LeaseInfo]) -> None:
        """The answer of ``GET /v1/leases/{name}`` after the stream was opened again (None: 404)."""
        self.need_recheck = False
        if self.lost or self.closing:
            return
        if info is None:
            self.lose(REASON_NOT_HELD)
        elif info.lease_id != self.lease_id or (info.fencing_token is not None and info.fencing_token != self.token):
            self.lose(REASON_SUPERSEDED)
        elif info.state == "lost" or info.fencing_token is None:
            self.lose(info.lost_reason or "lost")
        else:
            self.granted_seen = True
            if info.expires_at is not None:
                self.expires_at = info.expires_at
            self.at_risk_reason = AT_RISK_DEGRADED if info.state == "degraded" else None

    def lose(self, reason: str) -> bool:
        """Declare the lease lost for ``reason``; True if this call made it lost."""
        if self.lost:
            return False
        self.lost_reason = reason
        if self.at_risk_reason is None:
            self.at_risk_reason = "lost (%s)" % reason
        return True
