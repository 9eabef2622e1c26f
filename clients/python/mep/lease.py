"""A lease held through mepd, bound to the calling process, as a context manager whose
at-risk and lost states are :class:`threading.Event` objects fed by the daemon's event
stream and by a local deadline (see :mod:`mep._tracker` for the rules).

The current lease of a ``with`` block is kept in a :class:`contextvars.ContextVar`, so code
deep in a call stack (a storage helper) finds it with :func:`current_lease`.
"""
from __future__ import annotations

import contextvars
import datetime
import logging
import select
import socket
import threading
import time
import types
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Type

from . import _args, _calls, _http
from ._tracker import LossTracker
from .errors import LeaseLost, LeaseNotFound, MepError, NotFound, StaleFence
from .types import Event, LeaseInfo, SyncResult, VerifyResult

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

__all__ = ["LeaseBase", "Lease", "LeaseContext", "current_lease"]

log = logging.getLogger("mep")

_current: "contextvars.ContextVar[Optional[LeaseBase]]" = contextvars.ContextVar("mep_current_lease", default=None)

# How often the watcher looks at the clock while nothing arrives (it also wakes at the deadline).
_POLL_S = 0.5
# Reconnecting the event stream after it ended: first and largest pause.
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
# Timeouts of the watcher's own requests (reconnect, re-check).
_WATCH_REQUEST_TIMEOUT_S = 5.0


def _transfer_timeout(timeout: Optional[float]) -> float:
    """The timeout of a sync as the client's ``_request`` takes it (``inf``: no limit)."""
    t = _args.timeout(timeout)
    return float("inf") if t is None else t


def current_lease() -> "Optional[LeaseBase]":
    """The lease of the innermost ``with mep.lease(...)`` (or ``async with
    mep.aio.lease(...)``) block of the current context, or None outside any.

    Context variables follow asyncio tasks; a new :class:`threading.Thread` starts with
    an empty context unless it is started through :func:`contextvars.copy_context`.
    """
    return _current.get()


class LeaseBase:
    """What a lease is, the same for the threaded :class:`Lease` and the asyncio
    :class:`mep.aio.AsyncLease`: identity, token, expiry and the fencing header."""

    _info: LeaseInfo
    _tracker: LossTracker
    _released: bool
    _release_problem: Optional[MepError] = None

    @property
    def info(self) -> LeaseInfo:
        """The daemon's answer to the attach."""
        return self._info

    @property
    def token(self) -> int:
        """The fencing token of this lease (strictly increasing per memory)."""
        return int(self._info.fencing_token or 0)

    @property
    def fencing_token(self) -> int:
        """Same as :attr:`token`."""
        return self.token

    @property
    def lease_id(self) -> str:
        """The control plane's id of this lease."""
        return self._info.lease_id

    @property
    def memory_instance_id(self) -> str:
        """The id of the memory this lease holds (stable across moves and copies of the file)."""
        return self._info.memory_instance_id

    @property
    def canonical_name(self) -> str:
        """The canonical agent name (``"My Agent"`` → ``"myagent"``)."""
        return self._info.canonical_name

    @property
    def display_name(self) -> str:
        """The agent name as given, NFC-normalized and trimmed."""
        return self._info.display_name

    @property
    def path(self) -> str:
        """The memory file's absolute path, as the daemon resolved it."""
        return self._info.path

    @property
    def ttl_seconds(self) -> int:
        """The lease's time to live in seconds."""
        return int(self._info.ttl_seconds or self._tracker.ttl)

    @property
    def expires_at(self) -> Optional[datetime.datetime]:
        """When the control plane lets the lease expire (aware UTC datetime), updated on
        each renewal the daemon reports."""
        return self._tracker.expires_at

    @property
    def lost_reason(self) -> Optional[str]:
        """Why the lease was lost, or None while it is not: from the daemon ``deadline``,
        ``stale-fence``, ``lease-expired``, ``max-hold`` (a renewal would have carried the
        lease past its ``max_hold``), ``revoked`` (an operator ran ``mep lease revoke``);
        from the SDK ``local-deadline``, ``released``, ``superseded``, ``not-held``, ..."""
        return self._tracker.lost_reason

    @property
    def at_risk_reason(self) -> Optional[str]:
        """Why the lease is at risk (``degraded (...)``, ``daemon-unreachable``, ``lost (...)``), or None."""
        return self._tracker.at_risk_reason

    @property
    def released(self) -> bool:
        """Whether this process released the lease (the block ended or :meth:`release`
        returned). False after a :meth:`release` that raised: call it again."""
        return self._released

    @property
    def release_problem(self) -> Optional[MepError]:
        """After a release the control plane did not confirm, its problem (e.g.
        :class:`~mep.Unavailable`): the lease ended on this host, but the control plane may
        hold the name until the lease expires there. None otherwise."""
        return self._release_problem

    def _released_with(self, problem: Optional[MepError]) -> Optional[MepError]:
        """Keeps and logs what the daemon's detach said of the control plane; returns it."""
        if problem is not None:
            self._release_problem = problem
            log.warning("released %s on this host, but the control plane did not confirm it (%s): "
                        "it may hold the name until the lease expires there", self.canonical_name, problem)
        return self._release_problem

    def _given_up(self) -> bool:
        """Lost, released, or :meth:`release` was called (even if it failed): the token
        must not be used any more."""
        return self._tracker.lost or self._released or self._tracker.closing

    def seconds_left(self) -> Optional[float]:
        """Seconds until the SDK's local deadline (how long the lease can be relied on
        without hearing of another renewal); None before the attach answered."""
        return self._tracker.seconds_to_deadline(time.monotonic())

    def _lost_error(self) -> LeaseLost:
        if self._tracker.lost:
            reason = self._tracker.lost_reason or "lost"
            detail = "the lease on %s (token %d) was lost: %s" % (self.canonical_name, self.token, reason)
        elif self._released:
            reason = "closed"
            detail = "the lease on %s (token %d) was released by this process" % (self.canonical_name, self.token)
        else:
            reason = "closed"
            detail = ("the lease on %s (token %d) is being released by this process (a release that failed "
                      "is retried by calling release() again)" % (self.canonical_name, self.token))
        return LeaseLost(
            detail,
            extensions={"reason": reason, "canonical_name": self.canonical_name,
                        "memory_instance_id": self.memory_instance_id, "fencing_token": self.token},
        )

    def fencing_headers(self, strict: bool = True) -> Dict[str, str]:
        """``{"Fencing-Token": "<token>"}`` for the agent's own writes to a fenced store
        (``mep store`` or any storage that applies the rule of SPEC §8). With ``strict``
        (the default) raises :class:`~mep.LeaseLost` first if the SDK considers the lease
        lost, or once it was released (``reason == "closed"``), as :meth:`check` does;
        ``strict=False`` returns the header anyway. The store stays the authority either
        way (a superseded token gets 409)."""
        if strict and self._given_up():
            raise self._lost_error()
        return {"Fencing-Token": str(self.token)}

    def __repr__(self) -> str:
        state = "released" if self._released else ("lost" if self._tracker.lost else (
            "releasing" if self._tracker.closing else ("at-risk" if self._tracker.at_risk else "held")))
        return "<%s %s token=%d memory=%s %s>" % (type(self).__name__, self.canonical_name, self.token,
                                                 self.memory_instance_id, state)


class Lease(LeaseBase):
    """A lease on (name, memory) held through mepd for this process. Made by
    :func:`mep.acquire` / :meth:`Client.acquire`, or by ``with mep.lease(...) as lease``.

    ``at_risk`` and ``lost`` are :class:`threading.Event` objects: wait on them, poll
    them, or register :meth:`on_lost`. Loss is final. Use as a context manager (or call
    :meth:`release`) to give the lease up.
    """

    #: Set while the lease is at risk (renewals failing, daemon unreachable, or lost).
    at_risk: threading.Event
    #: Set once the lease is lost; final.
    lost: threading.Event

    def __init__(self, client: "Client", conn: _http.EventConnection, ttl_hint: float) -> None:
        """Internal: use :meth:`Client.acquire`. Starts watching ``conn`` at once."""
        self._client = client
        self._conn: Optional[_http.EventConnection] = conn
        self._tracker = LossTracker(ttl_hint)
        self._lock = threading.Lock()
        self._released = False
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._callbacks: List[Callable[["Lease"], Any]] = []
        self._callbacks_fired = False
        self._cv_tokens: "List[contextvars.Token[Optional[LeaseBase]]]" = []
        self.at_risk = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mep-lease-watch", daemon=True)
        self._thread.start()

    # ---- set-up, called by Client.acquire ------------------------------------------------
    def _set_attached(self, info: LeaseInfo, sent_at: float) -> None:
        self._info = info
        with self._lock:
            self._tracker.attached(info, sent_at)
        self._apply_flags()
        self._wake()

    def _abort(self) -> None:
        """The attach failed: stop watching, nothing to release."""
        self._released = True
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        self._close_conn()
        self._close_wake()

    # ---- public ------------------------------------------------------------------------
    def on_lost(self, callback: Callable[["Lease"], Any]) -> None:
        """Call ``callback(lease)`` once when the lease is lost, from the SDK's watcher
        thread — or at once, in this thread, if it is already lost. An exception in the
        callback is logged (logger ``mep``) and otherwise ignored."""
        with self._lock:
            immediate = self._tracker.lost
            if not immediate:
                self._callbacks.append(callback)
        if immediate:
            self._run_callback(callback)

    def check(self) -> None:
        """Raise :class:`~mep.LeaseLost` if the lease is lost (or already released); look
        at the local deadline first, so a watcher thread that has not run yet cannot make
        this answer late. Cheap: no I/O."""
        with self._lock:
            self._tracker.tick(time.monotonic())
            gone = self._given_up()
        self._apply_flags()
        if gone:
            raise self._lost_error()

    def verify(self) -> VerifyResult:
        """Ask the control plane, through the daemon (``POST /v1/verify``), whether this
        lease's token is still the memory's current one — before an irreversible step.

        Raises :class:`~mep.LeaseLost` if the SDK already considers it lost,
        :class:`~mep.StaleFence` (409) or :class:`~mep.LeaseExpired` (410) if the control
        plane says it is gone (the lease is then marked lost), :class:`~mep.Unavailable`
        if the control plane cannot answer (nothing is known: do not proceed), and
        :class:`~mep.NotSupported` on a mepd that predates the endpoint.
        """
        self.check()
        # This lease by its id: after a loss the name may hold another agent's lease, whose
        # token can equal this one's (tokens count per memory).
        resp = self._client._request("POST", "/v1/verify", self._lease_body())
        if resp.refused_field("lease_id"):  # an older mepd: the memory id is compared below
            resp = self._client._request("POST", "/v1/verify", {"name": self.canonical_name})
        self._judge_answer(resp, "/v1/verify")
        result = VerifyResult.from_json(resp.json_object())
        if result.fencing_token != self.token or result.memory_instance_id != self.memory_instance_id:
            self._lose(StaleFence.CODE or "stale-fence")
            raise StaleFence("the control plane's current lease for %s is token %d on memory %s; this lease's "
                             "is token %d on %s" % (self.canonical_name, result.fencing_token,
                                                    result.memory_instance_id, self.token, self.memory_instance_id),
                             extensions={"presented_token": self.token, "current_token": result.fencing_token})
        if result.expires_at is not None:
            with self._lock:
                if self._tracker.expires_at is None or result.expires_at > self._tracker.expires_at:
                    self._tracker.expires_at = result.expires_at
        self.check()  # the local deadline may have passed while the answer came
        return result

    def sync(self, *, timeout: Optional[float] = None) -> SyncResult:
        """Upload the memory file's bytes to the data plane under this lease's token
        (``POST /v1/sync``). Raises :class:`~mep.LeaseLost` first if the lease is lost;
        :class:`~mep.StaleFence` if the store has seen a newer token (the lease is then
        marked lost); :class:`~mep.StoreUnavailable`, :class:`~mep.InsufficientStorage`,
        :class:`~mep.StoreNotConfigured` (mepd without ``--store``), or
        :class:`~mep.NotSupported` on a mepd that predates the endpoint.

        ``timeout``: seconds to wait for the daemon's answer (:class:`~mep.DaemonTimeout`
        after that). None (the default) sets no limit: the daemon answers only once the
        upload is done, however long a large file takes, and itself gives up on a transfer
        that makes no progress for 30 s. The client's ``timeout`` does not apply."""
        limit = _transfer_timeout(timeout)
        self.check()
        resp = self._client._request("POST", "/v1/sync", self._lease_body(), timeout=limit)
        if resp.refused_field("lease_id"):  # an older mepd
            resp = self._client._request("POST", "/v1/sync", {"name": self.canonical_name}, timeout=limit)
        self._judge_answer(resp, "/v1/sync")
        result = SyncResult.from_json(resp.json_object())
        self.check()  # lost while it uploaded: the answer does not count
        return result

    def _lease_body(self) -> Dict[str, Any]:
        return {"name": self.canonical_name, "lease_id": self.lease_id}

    def refresh(self) -> LeaseInfo:
        """The daemon's current view of this lease (``GET /v1/leases/{name}``)."""
        return self._client.get_lease(self.canonical_name)

    def release(self) -> Optional[MepError]:
        """Give the lease up (``POST /v1/detach``); idempotent once it succeeded. A lease
        the daemon already gave up (lost, or released by someone else) is only forgotten.
        Callbacks of a loss that was not reported yet run before this returns.

        Returns None, or :attr:`release_problem` when the control plane did not confirm
        the release (also logged as a warning): the lease is released here all the same.

        From the first call on the token is not to be used (:meth:`check` and
        :meth:`fencing_headers` raise :class:`~mep.LeaseLost`) and the lease is no longer
        watched. If the daemon cannot be reached (:class:`~mep.DaemonNotRunning`,
        :class:`~mep.DaemonTimeout`, ...) the error propagates and the lease is *not*
        released — the daemon keeps it (a restarted mepd re-adopts it) until the process
        exits: call :meth:`release` again, and once the daemon answers it is released."""
        with self._lock:
            if self._released:
                return self._release_problem
            first = not self._tracker.closing
            self._tracker.closing = True
        if first:
            self._stop.set()
            self._wake()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=10)
            self._close_conn()
            self._fire_callbacks()
            self._close_wake()
        problem = self._detach_if_ours()  # raises if the daemon cannot be asked: release() again retries
        with self._lock:
            self._released = True
        return self._released_with(problem)

    # ---- context manager ---------------------------------------------------------------
    def __enter__(self) -> "Lease":
        self._cv_tokens.append(_current.set(self))
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[types.TracebackType],
    ) -> None:
        if self._cv_tokens:
            tok = self._cv_tokens.pop()
            try:
                _current.reset(tok)
            except ValueError:  # left in another context than entered
                _current.set(None)
        if exc_type is None:
            self.release()
            return
        try:
            self.release()
        except Exception as e:  # never mask the block's own exception
            log.warning("releasing the lease on %s after an exception in the block failed: %s",
                        self.canonical_name, e)

    # ---- internals ---------------------------------------------------------------------
    def _judge_answer(self, resp: _http.Response, target: str) -> None:
        if 200 <= resp.status < 300:
            return
        code = _calls.lost_by(resp)
        if code:
            self._lose(code)
        _http.raise_for(resp, target)

    def _lose(self, reason: str) -> None:
        with self._lock:
            self._tracker.lose(reason)
        self._apply_flags()
        self._wake()  # the watcher runs the callbacks

    def _detach_if_ours(self) -> Optional[MepError]:
        # Detach is by name: make sure the daemon's lease under the name is still this one
        # (after a loss, another agent on this host may have attached the name since).
        # Returns the control plane's problem when it did not confirm the release.
        try:
            try:
                info = self._client.get_lease(self.canonical_name)
            except NotFound:
                return None
            if info.lease_id != self.lease_id:
                return None
            try:
                return self._client.detach(self.canonical_name, self.lease_id)
            except LeaseNotFound:
                return None
        except MepError as e:
            if not self._tracker.lost:
                raise
            # Lost already: there is nothing left to give up (a daemon that is gone
            # forgot it or lets it expire).
            log.debug("forgetting the lost lease on %s: %s", self.canonical_name, e)
            return None

    def _apply_flags(self) -> None:
        with self._lock:
            at_risk = self._tracker.at_risk
            lost = self._tracker.lost
        if at_risk and not self.at_risk.is_set():
            self.at_risk.set()
        elif not at_risk and self.at_risk.is_set():
            self.at_risk.clear()
        if lost and not self.lost.is_set():
            self.lost.set()

    def _run_callback(self, cb: Callable[["Lease"], Any]) -> None:
        try:
            cb(self)
        except Exception:
            log.exception("an on_lost callback of the lease on %s raised", self.canonical_name)

    def _fire_callbacks(self) -> None:
        with self._lock:
            if not self._tracker.lost or self._callbacks_fired:
                return
            self._callbacks_fired = True
            cbs, self._callbacks = self._callbacks, []
        for cb in cbs:
            self._run_callback(cb)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _close_wake(self) -> None:
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _feed(self, lines: List[bytes]) -> None:
        import json

        now = time.monotonic()
        for line in lines:
            try:
                doc = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                log.warning("mepd sent an event line that is not JSON: %r", line[:200])
                continue
            if not isinstance(doc, dict):
                continue
            try:
                ev = Event.from_json(doc)
            except MepError:
                continue
            with self._lock:
                self._tracker.event(ev, now)

    @staticmethod
    def _io_timeout(to_deadline: Optional[float]) -> float:
        # The watcher's own requests never hold it past the local deadline for long.
        if to_deadline is None:
            return _WATCH_REQUEST_TIMEOUT_S
        return max(0.25, min(_WATCH_REQUEST_TIMEOUT_S, to_deadline))

    def _recheck(self, timeout: float = _WATCH_REQUEST_TIMEOUT_S) -> bool:
        """GET the lease after the stream came back; False if no answer (try again later)."""
        name = self._tracker.canonical_name or ""
        try:
            resp = self._client._request("GET", "/v1/leases/" + urllib.parse.quote(name, safe=""),
                                         timeout=timeout)
        except MepError:
            return False
        answered, info = _calls.read_recheck(resp)
        if answered:
            with self._lock:
                self._tracker.recheck(info)
        return answered

    def _watch(self) -> None:
        """The watcher thread: reads events, enforces the local deadline, reconnects the
        stream with backoff after it ends and re-checks the lease, runs the callbacks."""
        backoff = _BACKOFF_FIRST_S
        next_connect = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                with self._lock:
                    self._tracker.tick(now)
                    to_deadline = self._tracker.seconds_to_deadline(now)
                    need_recheck = self._tracker.need_recheck and self._tracker.is_attached
                    lost = self._tracker.lost
                self._apply_flags()
                self._fire_callbacks()
                if lost:
                    # Nothing more to learn: stop reading (the daemon would queue events for
                    # us) and wait for release().
                    self._close_conn()
                    self._wait_wake(_POLL_S)
                    continue
                timeout = _POLL_S if to_deadline is None else max(0.0, min(_POLL_S, to_deadline))
                conn = self._conn
                if conn is None:
                    if now < next_connect:
                        self._wait_wake(min(timeout, next_connect - now))
                        continue
                    try:
                        sock_path, origin = self._client.resolve_socket()
                        new = _http.EventConnection.open(sock_path, origin, timeout=self._io_timeout(to_deadline))
                    except MepError:
                        next_connect = time.monotonic() + backoff
                        backoff = min(backoff * 2, _BACKOFF_MAX_S)
                        continue
                    backoff = _BACKOFF_FIRST_S
                    if self._stop.is_set():
                        new.close()
                        break
                    self._conn = new
                    continue
                if need_recheck:
                    if not self._recheck(self._io_timeout(to_deadline)):
                        self._wait_wake(min(timeout, backoff))
                        backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                lines = conn.pending_lines()
                if not lines:
                    try:
                        ready, _, _ = select.select([conn.sock, self._wake_r], [], [], timeout)
                    except (OSError, ValueError):
                        ready = [conn.sock]
                    if self._wake_r in ready:
                        self._drain_wake()
                    if conn.sock not in ready:
                        continue
                    got = conn.read_lines(0)
                    if got is None:
                        self._close_conn()
                        with self._lock:
                            self._tracker.stream_down()
                        next_connect = time.monotonic() + backoff
                        continue
                    lines = got
                self._feed(lines)
            except Exception:  # one failed iteration is logged; the watcher goes on
                log.exception("mep lease watcher")
                time.sleep(0.1)

    def _wait_wake(self, timeout: float) -> None:
        try:
            ready, _, _ = select.select([self._wake_r], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            time.sleep(max(0.0, min(timeout, 0.1)))
            return
        if ready:
            self._drain_wake()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass


class LeaseContext:
    """What :func:`mep.lease` returns: entering it attaches (``__enter__`` returns the
    :class:`Lease`), leaving it releases — also when the block raises, without masking
    the block's exception — and sets :func:`current_lease` for the block."""

    def __init__(self, client: "Client", name: str, path: Any, ttl: Optional[int], wait: Optional[float],
                 bind: str, *, labels: Optional[Mapping[str, str]] = None, max_hold: Optional[int] = None) -> None:
        self._client = client
        self._args = (name, path, ttl, wait, bind)
        self._labels = labels
        self._max_hold = max_hold
        self._lease: Optional[Lease] = None

    @property
    def lease(self) -> Optional[Lease]:
        """The lease once entered, else None."""
        return self._lease

    def __enter__(self) -> Lease:
        name, path, ttl, wait, bind = self._args
        lease = self._client.acquire(name, path, ttl=ttl, wait=wait, bind=bind, labels=self._labels,
                                     max_hold=self._max_hold)
        self._lease = lease
        return lease.__enter__()

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[types.TracebackType],
    ) -> None:
        if self._lease is not None:
            self._lease.__exit__(exc_type, exc, tb)

