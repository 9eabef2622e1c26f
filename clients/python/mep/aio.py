"""The asyncio flavour of the SDK: the same API as :mod:`mep`, with coroutines, on
HTTP/1.1 hand-rolled over :func:`asyncio.open_unix_connection`.

    import mep.aio

    async with mep.aio.lease("My Agent", "memory.uai", ttl=30) as lease:
        work = asyncio.create_task(agent_loop())
        await lease.lost.wait()          # an asyncio.Event
        work.cancel()

    async for event in mep.aio.events():
        print(event.event, event.canonical_name)

Loss is decided exactly as in the threaded SDK (:mod:`mep._tracker`); the watcher is a
task of the running loop, and ``on_lost`` callbacks run in that loop.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import logging
import os
import time
import types
import urllib.parse
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Tuple, Type, Union

from . import _args, _calls, _config, _http
from ._tracker import LossTracker
from .client import (CLI_TIMEOUT_S, DEFAULT_TIMEOUT_S, PathLike, _attach_body, _detach_body,
                     parse_canonicalize_output)
from .errors import (
    DaemonTimeout,
    InvalidName,
    LeaseNotFound,
    MepError,
    NotFound,
    ProtocolError,
    StaleFence,
    Unavailable,
)
from .lease import _current, LeaseBase, _transfer_timeout, current_lease
from .types import (
    BranchResult,
    CanonicalName,
    Event,
    FetchResult,
    Health,
    LeaseInfo,
    Lineage,
    MemoryIdentity,
    SyncResult,
    VerifyResult,
)

__all__ = [
    "AsyncClient",
    "AsyncLease",
    "AsyncLeaseContext",
    "AsyncEventStream",
    "lease",
    "acquire",
    "events",
    "canonicalize",
    "init",
    "branch",
    "identify",
    "lineage",
    "status",
    "fetch",
    "health",
    "current_lease",
    "default_client",
]

log = logging.getLogger("mep")

_STREAM_LIMIT = _http.MAX_EVENT_LINE_BYTES
_POLL_S = 0.5
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 2.0
_WATCH_REQUEST_TIMEOUT_S = 5.0

LostCallback = Callable[["AsyncLease"], Union[None, Awaitable[Any]]]


async def _open(socket_path: str, origin: str, timeout: float
                ) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # Connecting is always bounded, even when the answer may take any time.
    try:
        return await asyncio.wait_for(asyncio.open_unix_connection(socket_path, limit=_STREAM_LIMIT), timeout)
    except asyncio.TimeoutError:
        raise DaemonTimeout("mepd at %s did not accept the connection within %.0f s" % (socket_path, timeout)) from None
    except OSError as e:
        raise _http.not_running(socket_path, origin, e) from None


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, asyncio.CancelledError):
        pass


async def request(socket_path: str, origin: str, method: str, target: str, body: Optional[Any] = None,
                  timeout: Optional[float] = DEFAULT_TIMEOUT_S,
                  connect_timeout: Optional[float] = None) -> _http.Response:
    """One request/response on a fresh connection within ``timeout`` seconds (None: no
    limit on the answer; connecting within ``connect_timeout``, default ``timeout`` else
    30 s) — the async twin of :func:`mep._http.request`."""
    if connect_timeout is None:
        connect_timeout = timeout if timeout is not None else _http.DEFAULT_CONNECT_TIMEOUT_S
    reader, writer = await _open(socket_path, origin, connect_timeout)
    parser = _http.ResponseParser()

    async def exchange() -> None:
        writer.write(_http.build_request(method, target, body))
        try:
            await writer.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # a daemon that refuses the peer answers without reading
        while not parser.done:
            try:
                data = await reader.read(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                parser.finish()
                break
            parser.feed(data)

    try:
        await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        raise DaemonTimeout("mepd at %s did not answer %s %s within %g s" % (socket_path, method, target, timeout)) from None
    finally:
        await _close(writer)
    return parser.response()


class _AsyncEventConnection:
    """``GET /v1/events`` on an asyncio stream; :meth:`open` returns once subscribed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.closed = False

    @classmethod
    async def open(cls, socket_path: str, origin: str, timeout: float = 10.0) -> "_AsyncEventConnection":
        reader, writer = await _open(socket_path, origin, timeout)
        try:
            writer.write(_http.build_request("GET", "/v1/events"))
            await asyncio.wait_for(writer.drain(), timeout)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
            status, headers = _http.parse_head(head[:-4])
            if status != 200:
                parser = _http.ResponseParser()
                parser.feed(head)
                while not parser.done:
                    data = await asyncio.wait_for(reader.read(65536), timeout)
                    if not data:
                        parser.finish()
                        break
                    parser.feed(data)
                raise parser.response().error()
        except asyncio.TimeoutError:
            await _close(writer)
            raise DaemonTimeout("mepd at %s did not start the event stream within %.0f s" % (socket_path, timeout)) from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as e:
            await _close(writer)
            raise Unavailable("the event stream from mepd at %s failed: %s" % (socket_path, e)) from None
        except BaseException:
            await _close(writer)
            raise
        return cls(reader, writer)

    async def readline(self, timeout: Optional[float]) -> Optional[bytes]:
        """One line (stripped; may be empty), b"" on timeout, None once the stream ended."""
        if self.closed:
            return None
        try:
            if timeout is None:
                line = await self.reader.readline()
            else:
                line = await asyncio.wait_for(self.reader.readline(), max(0.0, timeout))
        except asyncio.TimeoutError:
            return b""
        except (OSError, ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            line = b""
        if not line:
            self.closed = True
            return None
        return line.strip()

    async def close(self) -> None:
        self.closed = True
        if not self.writer.is_closing():
            await _close(self.writer)


def _event_from_line(line: bytes) -> Optional[Event]:
    if not line:
        return None
    try:
        doc = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        log.warning("mepd sent an event line that is not JSON: %r", line[:200])
        return None
    if not isinstance(doc, dict):
        return None
    try:
        return Event.from_json(doc)
    except MepError:
        return None


class AsyncEventStream:
    """``GET /v1/events`` as an async iterator of :class:`~mep.types.Event`; it ends when
    the daemon closes the stream. ``async with`` subscribes on entry (so nothing after it
    is missed) and closes on exit; plain ``async for`` subscribes on the first step."""

    def __init__(self, client: "AsyncClient") -> None:
        self._client = client
        self._conn: Optional[_AsyncEventConnection] = None

    async def open(self) -> "AsyncEventStream":
        """Subscribe now (idempotent)."""
        if self._conn is None:
            path, origin = self._client.resolve_socket()
            self._conn = await _AsyncEventConnection.open(path, origin, timeout=min(self._client.timeout, 10.0))
        return self

    def __aiter__(self) -> "AsyncEventStream":
        return self

    async def __anext__(self) -> Event:
        await self.open()
        assert self._conn is not None
        while True:
            line = await self._conn.readline(None)
            if line is None:
                await self._conn.close()
                raise StopAsyncIteration
            ev = _event_from_line(line)
            if ev is not None:
                return ev

    async def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event within ``timeout`` seconds (None: no limit); None on timeout or end."""
        await self.open()
        assert self._conn is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            line = await self._conn.readline(left)
            if line is None:
                await self._conn.close()
                return None
            ev = _event_from_line(line)
            if ev is not None:
                return ev

    async def aclose(self) -> None:
        """Stop listening."""
        if self._conn is not None:
            await self._conn.close()

    async def __aenter__(self) -> "AsyncEventStream":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncLease(LeaseBase):
    """The asyncio twin of :class:`mep.Lease`: ``at_risk`` and ``lost`` are
    :class:`asyncio.Event` objects (``await lease.lost.wait()``), :meth:`verify`,
    :meth:`sync` and :meth:`release` are coroutines. Made by :func:`acquire` or
    ``async with mep.aio.lease(...) as lease``; bound to the loop it was made in."""

    at_risk: asyncio.Event
    lost: asyncio.Event

    def __init__(self, client: "AsyncClient", conn: _AsyncEventConnection, ttl_hint: float) -> None:
        """Internal: use :meth:`AsyncClient.acquire`. Starts the watcher task at once."""
        self._client = client
        self._conn: Optional[_AsyncEventConnection] = conn
        self._tracker = LossTracker(ttl_hint)
        self._released = False
        self._callbacks: List[LostCallback] = []
        self._callbacks_fired = False
        self._cv_tokens: "List[contextvars.Token[Optional[LeaseBase]]]" = []
        self._loop = asyncio.get_running_loop()
        self.at_risk = asyncio.Event()
        self.lost = asyncio.Event()
        self._wake = asyncio.Event()
        self._stopping = False
        self._read_task: "Optional[asyncio.Task[bytes]]" = None
        self._wake_task: "Optional[asyncio.Task[Any]]" = None
        self._task: "asyncio.Task[None]" = self._loop.create_task(self._watch())

    def _set_attached(self, info: LeaseInfo, sent_at: float) -> None:
        self._info = info
        self._tracker.attached(info, sent_at)
        self._apply_flags()
        self._wake.set()

    async def _abort(self) -> None:
        self._released = True
        await self._stop_watcher()

    # ---- public ------------------------------------------------------------------------
    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease)`` once when the lease is lost, in the event loop (a
        coroutine it returns is scheduled as a task); at once if already lost."""
        if self._tracker.lost:
            self._run_callback(callback)
        else:
            self._callbacks.append(callback)

    def check(self) -> None:
        """Raise :class:`~mep.LeaseLost` if the lease is lost (or released, or being
        released); consults the local deadline first. No I/O."""
        self._tracker.tick(time.monotonic())
        self._apply_flags()
        if self._given_up():
            if self._tracker.lost:
                self._loop.call_soon(self._fire_callbacks)
            raise self._lost_error()

    async def verify(self) -> VerifyResult:
        """Ask the control plane through the daemon (``POST /v1/verify``) whether the token
        is current; raises like :meth:`mep.Lease.verify`."""
        self.check()
        resp = await self._client._request("POST", "/v1/verify", self._lease_body())
        if resp.refused_field("lease_id"):  # an older mepd: the memory id is compared below
            resp = await self._client._request("POST", "/v1/verify", {"name": self.canonical_name})
        self._judge_answer(resp, "/v1/verify")
        result = VerifyResult.from_json(resp.json_object())
        if result.fencing_token != self.token or result.memory_instance_id != self.memory_instance_id:
            self._lose("stale-fence")
            raise StaleFence("the control plane's current lease for %s is token %d on memory %s; this lease's "
                             "is token %d on %s" % (self.canonical_name, result.fencing_token,
                                                    result.memory_instance_id, self.token, self.memory_instance_id),
                             extensions={"presented_token": self.token, "current_token": result.fencing_token})
        if result.expires_at is not None and (self._tracker.expires_at is None or
                                              result.expires_at > self._tracker.expires_at):
            self._tracker.expires_at = result.expires_at
        self.check()
        return result

    async def sync(self, *, timeout: Optional[float] = None) -> SyncResult:
        """Upload the memory file under this lease's token (``POST /v1/sync``); raises like
        :meth:`mep.Lease.sync`. ``timeout``: seconds to wait for the answer; None (default):
        no limit, however long the upload takes (the client's ``timeout`` does not apply)."""
        limit = _transfer_timeout(timeout)
        self.check()
        resp = await self._client._request("POST", "/v1/sync", self._lease_body(), timeout=limit)
        if resp.refused_field("lease_id"):  # an older mepd
            resp = await self._client._request("POST", "/v1/sync", {"name": self.canonical_name}, timeout=limit)
        self._judge_answer(resp, "/v1/sync")
        result = SyncResult.from_json(resp.json_object())
        self.check()
        return result

    def _lease_body(self) -> Dict[str, Any]:
        return {"name": self.canonical_name, "lease_id": self.lease_id}

    async def refresh(self) -> LeaseInfo:
        """The daemon's current view of this lease."""
        return await self._client.get_lease(self.canonical_name)

    async def release(self) -> Optional[MepError]:
        """Give the lease up (idempotent once it succeeded); see :meth:`mep.Lease.release`:
        if the daemon cannot be reached the error propagates, the lease stays held by the
        daemon and calling :meth:`release` again retries. Returns :attr:`release_problem`
        (None when the control plane confirmed the release)."""
        if self._released:
            return self._release_problem
        first = not self._tracker.closing
        self._tracker.closing = True
        if first:
            await self._stop_watcher()
            self._fire_callbacks()
        problem = await self._detach_if_ours()  # raises if the daemon cannot be asked: release() again retries
        self._released = True
        return self._released_with(problem)

    async def __aenter__(self) -> "AsyncLease":
        self._cv_tokens.append(_current.set(self))
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                        tb: Optional[types.TracebackType]) -> None:
        if self._cv_tokens:
            tok = self._cv_tokens.pop()
            try:
                _current.reset(tok)
            except ValueError:
                _current.set(None)
        if exc_type is None:
            await self.release()
            return
        try:
            await self.release()
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
        self._tracker.lose(reason)
        self._apply_flags()
        self._loop.call_soon(self._fire_callbacks)

    async def _stop_watcher(self) -> None:
        # A flag and a wake-up, not Task.cancel(): the watcher ends by itself, so no
        # CancelledError has to be told apart from one aimed at the caller.
        self._stopping = True
        self._wake.set()
        task = self._task
        if task is not asyncio.current_task() and not task.done():
            await asyncio.wait({task}, timeout=10)
            if not task.done():  # pragma: no cover - a watcher stuck in a request
                task.cancel()
                await asyncio.wait({task}, timeout=5)
        self._drop_helpers()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    def _drop_helpers(self) -> None:
        for t in (self._read_task, self._wake_task):
            if t is not None and not t.done():
                t.cancel()
                t.add_done_callback(_retrieve)
        self._read_task = None
        self._wake_task = None

    async def _detach_if_ours(self) -> Optional[MepError]:
        try:
            try:
                info = await self._client.get_lease(self.canonical_name)
            except NotFound:
                return None
            if info.lease_id != self.lease_id:
                return None
            try:
                return await self._client.detach(self.canonical_name, self.lease_id)
            except LeaseNotFound:
                return None
        except MepError as e:
            if not self._tracker.lost:
                raise
            log.debug("forgetting the lost lease on %s: %s", self.canonical_name, e)
            return None

    def _apply_flags(self) -> None:
        if self._tracker.at_risk and not self.at_risk.is_set():
            self.at_risk.set()
        elif not self._tracker.at_risk and self.at_risk.is_set():
            self.at_risk.clear()
        if self._tracker.lost and not self.lost.is_set():
            self.lost.set()

    def _run_callback(self, cb: LostCallback) -> None:
        try:
            r = cb(self)
            if inspect.isawaitable(r):
                fut = asyncio.ensure_future(r)
                fut.add_done_callback(_log_task_error)
        except Exception:
            log.exception("an on_lost callback of the lease on %s raised", self.canonical_name)

    def _fire_callbacks(self) -> None:
        if not self._tracker.lost or self._callbacks_fired:
            return
        self._callbacks_fired = True
        cbs, self._callbacks = self._callbacks, []
        for cb in cbs:
            self._run_callback(cb)

    async def _recheck(self, timeout: float = _WATCH_REQUEST_TIMEOUT_S) -> bool:
        name = self._tracker.canonical_name or ""
        try:
            resp = await self._client._request("GET", "/v1/leases/" + urllib.parse.quote(name, safe=""),
                                               timeout=timeout)
        except MepError:
            return False
        answered, info = _calls.read_recheck(resp)
        if answered:
            self._tracker.recheck(info)
        return answered

    def _wake_waiter(self) -> "asyncio.Task[Any]":
        if self._wake_task is None:
            self._wake_task = self._loop.create_task(self._wake.wait())
        return self._wake_task

    def _consume_wake(self) -> None:
        if self._wake_task is not None and self._wake_task.done():
            self._wake_task = None
            self._wake.clear()

    async def _wait_wake(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, or until woken."""
        await asyncio.wait({self._wake_waiter()}, timeout=max(0.0, timeout))
        self._consume_wake()

    async def _next_line(self, conn: _AsyncEventConnection, timeout: float) -> Optional[bytes]:
        """One line from the stream (b"" when none came within ``timeout`` or on a wake-up),
        None once it ended. The pending read survives a timeout, so no data is lost."""
        if self._read_task is None:
            self._read_task = self._loop.create_task(conn.reader.readline())
        await asyncio.wait({self._read_task, self._wake_waiter()}, timeout=max(0.0, timeout),
                           return_when=asyncio.FIRST_COMPLETED)
        self._consume_wake()
        if not self._read_task.done():
            return b""
        t, self._read_task = self._read_task, None
        try:
            line = t.result()
        except (OSError, ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError, asyncio.CancelledError):
            line = b""
        if not line:
            conn.closed = True
            return None
        return line.strip()

    async def _watch(self) -> None:
        """The watcher task: events, local deadline, reconnect with backoff and re-check."""
        backoff = _BACKOFF_FIRST_S
        next_connect = 0.0
        while not self._stopping:
            try:
                now = time.monotonic()
                self._tracker.tick(now)
                self._apply_flags()
                self._fire_callbacks()
                if self._tracker.lost:
                    conn, self._conn = self._conn, None
                    if conn is not None:
                        self._drop_helpers()
                        await conn.close()
                    await self._wait_wake(_POLL_S)
                    continue
                to_deadline = self._tracker.seconds_to_deadline(now)
                timeout = _POLL_S if to_deadline is None else max(0.0, min(_POLL_S, to_deadline))
                conn = self._conn
                if conn is None:
                    if now < next_connect:
                        await self._wait_wake(min(timeout, next_connect - now))
                        continue
                    try:
                        path, origin = self._client.resolve_socket()
                        self._conn = await _AsyncEventConnection.open(path, origin, timeout=_io_timeout(to_deadline))
                        backoff = _BACKOFF_FIRST_S
                    except MepError:
                        next_connect = time.monotonic() + backoff
                        backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                if self._tracker.need_recheck and self._tracker.is_attached:
                    if not await self._recheck(_io_timeout(to_deadline)):
                        await self._wait_wake(min(timeout, backoff))
                        backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
                line = await self._next_line(conn, timeout)
                if line is None:
                    self._conn = None
                    await conn.close()
                    self._tracker.stream_down()
                    next_connect = time.monotonic() + backoff
                    continue
                ev = _event_from_line(line)
                if ev is not None:
                    self._tracker.event(ev, time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed iteration is logged; the watcher goes on
                log.exception("mep lease watcher")
                await asyncio.sleep(0.1)
        self._drop_helpers()


def _io_timeout(to_deadline: Optional[float]) -> float:
    # The watcher's own requests never hold it past the local deadline for long.
    if to_deadline is None:
        return _WATCH_REQUEST_TIMEOUT_S
    return max(0.25, min(_WATCH_REQUEST_TIMEOUT_S, to_deadline))


def _retrieve(t: "asyncio.Future[Any]") -> None:
    if not t.cancelled():
        t.exception()


def _log_task_error(fut: "asyncio.Future[Any]") -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("an on_lost coroutine raised", exc_info=fut.exception())


class AsyncLeaseContext:
    """What :func:`lease` returns: ``async with`` acquires on entry and releases on exit
    (also when the block raises, without masking its exception)."""

    def __init__(self, client: "AsyncClient", name: str, path: PathLike, ttl: Optional[int],
                 wait: Optional[float], bind: str, *, labels: Optional[Mapping[str, str]] = None,
                 max_hold: Optional[int] = None) -> None:
        self._client = client
        self._args = (name, path, ttl, wait, bind)
        self._labels = labels
        self._max_hold = max_hold
        self._lease: Optional[AsyncLease] = None

    async def __aenter__(self) -> AsyncLease:
        name, path, ttl, wait, bind = self._args
        self._lease = await self._client.acquire(name, path, ttl=ttl, wait=wait, bind=bind, labels=self._labels,
                                                 max_hold=self._max_hold)
        return await self._lease.__aenter__()

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                        tb: Optional[types.TracebackType]) -> None:
        if self._lease is not None:
            await self._lease.__aexit__(exc_type, exc, tb)


class AsyncClient:
    """The asyncio client of mepd; same arguments and methods as :class:`mep.Client`, as
    coroutines."""

    def __init__(self, socket_path: Optional[PathLike] = None, *, timeout: float = DEFAULT_TIMEOUT_S,
                 mep_bin: Optional[str] = None) -> None:
        self._socket_path = os.fspath(socket_path) if socket_path is not None else None
        self.timeout = float(timeout)
        self.mep_bin = mep_bin

    def resolve_socket(self) -> Tuple[str, str]:
        """The socket path this client uses now, and where it came from."""
        if self._socket_path is not None:
            return self._socket_path, "the Client's socket_path"
        return _config.find_socket()

    @property
    def socket_path(self) -> str:
        """The socket path this client uses now."""
        return self.resolve_socket()[0]

    async def _request(self, method: str, target: str, body: Optional[Any] = None,
                       timeout: Optional[float] = None) -> _http.Response:
        """One request; ``timeout`` None is the client's :attr:`timeout`, ``math.inf`` no limit."""
        path, origin = self.resolve_socket()
        t = self.timeout if timeout is None else timeout
        return await request(path, origin, method, target, body, None if t == float("inf") else t,
                             connect_timeout=self.timeout)

    async def _obj(self, method: str, target: str, body: Optional[Any] = None,
                   timeout: Optional[float] = None) -> Dict[str, Any]:
        resp = await self._request(method, target, body, timeout)
        _http.raise_for(resp, target)
        doc = resp.json()
        if not isinstance(doc, dict):
            raise ProtocolError("mepd answered %s %s without a JSON object" % (method, target))
        return doc

    async def _run(self, call: _calls.Call) -> Any:
        """Sends ``call`` and reads its answer (see :mod:`mep._calls`)."""
        return call.decode(await self._obj(call.method, call.target, call.body, call.timeout_for(self.timeout)))

    async def acquire(self, name: str, path: PathLike, *, ttl: Optional[int] = 30, wait: Optional[float] = None,
                      bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
                      max_hold: Optional[int] = None) -> AsyncLease:
        """Attach and return the held :class:`AsyncLease` (see :meth:`mep.Client.acquire`
        for the arguments, ``labels`` and ``max_hold`` included, and the errors)."""
        body = _attach_body(name, path, ttl, wait, bind, labels, max_hold)
        wait = body.get("wait_seconds")
        sock_path, origin = self.resolve_socket()
        conn = await _AsyncEventConnection.open(sock_path, origin, timeout=min(self.timeout, 10.0))
        lease = AsyncLease(self, conn, float(body.get("ttl_seconds") or 30))
        try:
            sent = time.monotonic()
            resp = await request(sock_path, origin, "POST", "/v1/attach", body, self.timeout + (wait or 0.0))
            _http.raise_for(resp, "/v1/attach")
            info = LeaseInfo.from_json(resp.json_object())
            # After a wait the grant is no earlier than the request plus this: the local
            # deadline counts from there (else a wait longer than the TTL is a lost lease).
            after = info.raw.get("granted_after_ms")
            if isinstance(after, int) and not isinstance(after, bool) and after > 0:
                sent += after / 1000.0
        except BaseException:
            await lease._abort()
            raise
        lease._set_attached(info, sent)
        return lease

    def lease(self, name: str, path: PathLike, ttl: Optional[int] = 30, wait: Optional[float] = None, *,
              bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
              max_hold: Optional[int] = None) -> AsyncLeaseContext:
        """``async with client.lease(...) as lease:``."""
        body = _attach_body(name, path, ttl, wait, bind, labels, max_hold)  # wrong arguments raise here, not on entry
        return AsyncLeaseContext(self, name, path, ttl, wait, bind, labels=body.get("labels"), max_hold=max_hold)

    async def attach(self, name: str, path: PathLike, *, ttl: Optional[int] = None, wait: Optional[float] = None,
                     bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
                     max_hold: Optional[int] = None) -> LeaseInfo:
        """The bare ``POST /v1/attach`` (no event stream, no loss tracking): prefer
        :meth:`acquire`. See :meth:`mep.Client.attach`."""
        return await self._run(_calls.attach(_attach_body(name, path, ttl, wait, bind, labels, max_hold)))

    async def detach(self, name: str, lease_id: Optional[str] = None) -> Optional[MepError]:
        """``POST /v1/detach`` (with ``lease_id``: only that lease); returns the control
        plane's problem when it did not confirm the release, as :meth:`mep.Client.detach`."""
        resp = await self._request("POST", "/v1/detach", _detach_body(name, lease_id))
        _http.raise_for(resp, "/v1/detach")
        return _http.release_problem(resp)

    async def leases(self) -> List[LeaseInfo]:
        """``GET /v1/leases``."""
        return await self._run(_calls.leases())

    async def status(self) -> List[LeaseInfo]:
        """Same as :meth:`leases`."""
        return await self.leases()

    async def get_lease(self, name: str) -> LeaseInfo:
        """``GET /v1/leases/{name}``."""
        return await self._run(_calls.get_lease(name))

    async def verify(self, name: str) -> VerifyResult:
        """``POST /v1/verify``."""
        return await self._run(_calls.verify(name))

    async def sync(self, name: str, *, timeout: Optional[float] = None) -> SyncResult:
        """``POST /v1/sync``; ``timeout`` as :meth:`mep.Client.sync` (None: no limit)."""
        return await self._run(_calls.sync(name, _transfer_timeout(timeout)))

    async def fetch(self, memory_instance_id: str, path: PathLike, *, timeout: Optional[float] = None) -> FetchResult:
        """``POST /v1/fetch``; ``timeout`` as :meth:`mep.Client.fetch` (None: no limit)."""
        return await self._run(_calls.fetch(memory_instance_id, path, _transfer_timeout(timeout)))

    def events(self) -> AsyncEventStream:
        """The daemon's event stream (``async for`` / ``async with``)."""
        return AsyncEventStream(self)

    async def init(self, path: PathLike) -> MemoryIdentity:
        """``POST /v1/init``."""
        return await self._run(_calls.init(path))

    async def branch(self, path: PathLike, new_path: PathLike) -> BranchResult:
        """``POST /v1/branch``."""
        return await self._run(_calls.branch(path, new_path))

    async def identify(self, path: PathLike) -> MemoryIdentity:
        """``GET /v1/identify``."""
        return await self._run(_calls.identify(path))

    async def lineage(self, path_or_id: PathLike) -> Lineage:
        """``GET /v1/lineage`` by path or memory id."""
        return await self._run(_calls.lineage(path_or_id))

    async def health(self) -> Health:
        """``GET /healthz``."""
        return await self._run(_calls.health())

    async def canonicalize(self, name: str) -> CanonicalName:
        """Like :meth:`mep.Client.canonicalize`, running the CLI as an asyncio subprocess."""
        _args.text(name, "name")
        if "\x00" in name:
            i = name.index("\x00")
            raise InvalidName("invalid agent name: disallowed character U+0000 at index %d" % i,
                              extensions={"reason": "disallowed-character", "codepoint": "U+0000", "index": i})
        binary = self.mep_bin or _config.find_mep_bin()
        try:
            proc = await asyncio.create_subprocess_exec(binary, "canonicalize", "--json", "--", name,
                                                        stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            raise MepError("cannot run %s: %s" % (binary, e.strerror or e)) from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise MepError("'mep canonicalize' did not finish within %.0f s" % CLI_TIMEOUT_S) from None
        return parse_canonicalize_output(proc.returncode or 0, out, err)


_default: Optional[AsyncClient] = None


def default_client() -> AsyncClient:
    """The :class:`AsyncClient` the module-level coroutines use."""
    global _default
    if _default is None:
        _default = AsyncClient()
    return _default


def lease(name: str, path: PathLike, ttl: Optional[int] = 30, wait: Optional[float] = None, *,
          bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
          max_hold: Optional[int] = None) -> AsyncLeaseContext:
    """``async with mep.aio.lease("My Agent", "memory.uai") as lease:`` (see :func:`mep.lease`)."""
    return default_client().lease(name, path, ttl, wait, bind=bind, labels=labels, max_hold=max_hold)


async def acquire(name: str, path: PathLike, ttl: Optional[int] = 30, wait: Optional[float] = None, *,
                  bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
                  max_hold: Optional[int] = None) -> AsyncLease:
    """Claim now; give it up with ``await lease.release()``."""
    return await default_client().acquire(name, path, ttl=ttl, wait=wait, bind=bind, labels=labels,
                                          max_hold=max_hold)


def events() -> AsyncEventStream:
    """``async for event in mep.aio.events():`` — the daemon's event stream."""
    return default_client().events()


async def canonicalize(name: str) -> CanonicalName:
    """See :func:`mep.canonicalize`."""
    return await default_client().canonicalize(name)


async def init(path: PathLike) -> MemoryIdentity:
    """See :func:`mep.init`."""
    return await default_client().init(path)


async def branch(path: PathLike, new_path: PathLike) -> BranchResult:
    """See :func:`mep.branch`."""
    return await default_client().branch(path, new_path)


async def identify(path: PathLike) -> MemoryIdentity:
    """See :func:`mep.identify`."""
    return await default_client().identify(path)


async def lineage(path_or_id: PathLike) -> Lineage:
    """See :func:`mep.lineage`."""
    return await default_client().lineage(path_or_id)


async def status() -> List[LeaseInfo]:
    """See :func:`mep.status`."""
    return await default_client().status()


async def fetch(memory_instance_id: str, path: PathLike, *, timeout: Optional[float] = None) -> FetchResult:
    """See :func:`mep.fetch`."""
    return await default_client().fetch(memory_instance_id, path, timeout=timeout)


async def health() -> Health:
    """See :func:`mep.health`."""
    return await default_client().health()

