"""The blocking client of mepd's socket API: one method per endpoint, answers as typed
values (:mod:`mep.types`), errors as exceptions (:mod:`mep.errors`). The module-level
functions of :mod:`mep` call a default instance of :class:`Client`."""
from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

from . import _args, _calls, _config, _http
from .errors import InvalidName, MepError, ProtocolError
from .lease import Lease, LeaseContext, _transfer_timeout
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

__all__ = ["Client", "EventStream", "PathLike"]

PathLike = Union[str, "os.PathLike[str]"]


#: Default seconds for one request/response with the daemon (it may wait on the control plane).
DEFAULT_TIMEOUT_S = 30.0
#: Default seconds to wait for ``mep canonicalize``.
CLI_TIMEOUT_S = 20.0


# The request bodies, shared with :mod:`mep.aio` (defined once, in _calls).
_attach_body = _calls.attach_body
_detach_body = _calls.detach_body


def canonicalize_with_cli(mep_bin: str, name: str, timeout: float = CLI_TIMEOUT_S) -> CanonicalName:
    """Run ``mep canonicalize --json -- NAME`` and read its answer (shared with :mod:`mep.aio`)."""
    _args.text(name, "name")
    if "\x00" in name:
        i = name.index("\x00")
        raise InvalidName("invalid agent name: disallowed character U+0000 at index %d" % i,
                          extensions={"reason": "disallowed-character", "codepoint": "U+0000", "index": i})
    try:
        p = subprocess.run([mep_bin, "canonicalize", "--json", "--", name], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise MepError("'mep canonicalize' did not finish within %.0f s" % timeout) from None
    except OSError as e:
        raise MepError("cannot run %s: %s" % (mep_bin, e.strerror or e)) from None
    return parse_canonicalize_output(p.returncode, p.stdout, p.stderr)


def parse_canonicalize_output(returncode: int, stdout: bytes, stderr: bytes) -> CanonicalName:
    """The :class:`CanonicalName` in ``mep canonicalize --json`` output, or its error raised."""
    line = stdout.decode("utf-8", "replace").strip().splitlines()[:1]
    if returncode not in (0, 6) or not line:
        raise MepError("'mep canonicalize' failed (exit %d): %s" % (returncode, stderr.decode("utf-8", "replace").strip()))
    try:
        doc = json.loads(line[0])
    except ValueError:
        raise ProtocolError("'mep canonicalize --json' printed something else than JSON: %r" % line[0][:200]) from None
    if not isinstance(doc, dict):
        raise ProtocolError("'mep canonicalize --json' printed %r" % doc)
    err = doc.get("error")
    if isinstance(err, dict):
        reason = err.get("reason")
        detail = "invalid agent name: %s" % reason
        if err.get("codepoint"):
            detail += " %s at index %s" % (err.get("codepoint"), err.get("index"))
        return_ext = dict(err)
        raise InvalidName(detail, extensions=return_ext)
    scripts = doc.get("scripts")
    return CanonicalName(
        input=str(doc.get("input", "")),
        canonical_name=str(doc.get("canonical_name", "")),
        skeleton=str(doc.get("skeleton", "")),
        scripts=[str(s) for s in scripts] if isinstance(scripts, list) else [],
        raw=doc,
    )


class EventStream:
    """``GET /v1/events`` as an iterator of :class:`~mep.types.Event`; it ends when the
    daemon closes the stream (it stops or restarts). Use as a context manager, or call
    :meth:`close`, to stop listening."""

    def __init__(self, conn: _http.EventConnection) -> None:
        self._conn = conn
        self._pending: List[Event] = []

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        while True:
            ev = self.next(timeout=None)
            if ev is not None:
                return ev
            if self._conn.closed and not self._pending:
                raise StopIteration

    def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event, waiting at most ``timeout`` seconds (None: until one comes);
        None on timeout or when the stream has ended (see :attr:`ended`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            if self._conn.closed:
                return None
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0 and deadline is not None:
                return None
            lines = self._conn.read_lines(max(0.0, min(left, 1.0)))
            if lines is None:
                return None
            for line in lines:
                try:
                    doc = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    continue
                if isinstance(doc, dict):
                    try:
                        self._pending.append(Event.from_json(doc))
                    except MepError:
                        continue
        return self._pending.pop(0)

    @property
    def ended(self) -> bool:
        """Whether the daemon closed the stream (or :meth:`close` was called)."""
        return self._conn.closed and not self._pending

    def close(self) -> None:
        """Stop listening."""
        self._conn.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Client:
    """A client of the local mepd.

    ``socket_path``: the daemon's socket; None finds it on each call the way the CLI does
    (``$MEP_SOCKET``, the config file's ``socket``, ``$XDG_RUNTIME_DIR/mep/mepd.sock``,
    ``/run/mep/mepd.sock``). ``timeout``: seconds for one request and its answer.
    ``mep_bin``: the ``mep`` CLI for :meth:`canonicalize` (None: ``$MEP_BIN``, else PATH).
    """

    def __init__(self, socket_path: Optional[PathLike] = None, *, timeout: float = DEFAULT_TIMEOUT_S,
                 mep_bin: Optional[str] = None) -> None:
        self._socket_path = os.fspath(socket_path) if socket_path is not None else None
        self.timeout = float(timeout)
        self.mep_bin = mep_bin

    # ---- plumbing ----------------------------------------------------------------------
    def resolve_socket(self) -> Tuple[str, str]:
        """The socket path this client uses now, and where it came from."""
        if self._socket_path is not None:
            return self._socket_path, "the Client's socket_path"
        return _config.find_socket()

    @property
    def socket_path(self) -> str:
        """The socket path this client uses now."""
        return self.resolve_socket()[0]

    def _request(self, method: str, target: str, body: Optional[Any] = None,
                 timeout: Optional[float] = None) -> _http.Response:
        """One request; ``timeout`` None is the client's :attr:`timeout`, ``math.inf`` no
        limit on the answer (connecting and sending still within :attr:`timeout`)."""
        path, origin = self.resolve_socket()
        t = self.timeout if timeout is None else timeout
        return _http.request(path, origin, method, target, body, None if t == float("inf") else t,
                             connect_timeout=self.timeout)

    def _call(self, method: str, target: str, body: Optional[Any] = None,
              timeout: Optional[float] = None) -> Any:
        resp = self._request(method, target, body, timeout)
        _http.raise_for(resp, target)
        return resp.json() if resp.status != 204 else None

    def _obj(self, method: str, target: str, body: Optional[Any] = None,
             timeout: Optional[float] = None) -> Dict[str, Any]:
        doc = self._call(method, target, body, timeout)
        if not isinstance(doc, dict):
            raise ProtocolError("mepd answered %s %s without a JSON object" % (method, target))
        return doc

    def _run(self, call: _calls.Call) -> Any:
        """Sends ``call`` and reads its answer (see :mod:`mep._calls`)."""
        return call.decode(self._obj(call.method, call.target, call.body, call.timeout_for(self.timeout)))

    # ---- leases ------------------------------------------------------------------------
    def acquire(self, name: str, path: PathLike, *, ttl: Optional[int] = 30, wait: Optional[float] = None,
                bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
                max_hold: Optional[int] = None) -> Lease:
        """Attach ``name`` to the memory file ``path`` and return the held :class:`Lease`
        (release it with :meth:`Lease.release` or a ``with`` block).

        The event stream is opened first, so no loss can slip in between. ``ttl`` is the
        lease's time to live (5..300 s); ``wait`` (seconds, or None) waits that long for a
        held name or memory, oldest waiter first; ``bind="pid"`` (default) binds the lease
        to this process: mepd releases it within about a second if the process exits,
        even by SIGKILL.

        ``labels`` (a mapping of ``str`` to ``str``, or None): up to 16 labels the control
        plane keeps with the lease for the operators of its tenant (``mep lease ls``,
        ``mep lease show``), beside the host name, this process's pid and executable name
        that mepd sends as the lease's *holder* (none of it when mepd runs with
        ``--anonymous-holder``); keys are 1-63 characters of ``A-Z a-z 0-9 _ . -``, values
        at most 255 bytes of printable UTF-8. ``max_hold`` (whole seconds, 5..31622400, or
        None: no limit): the lease is never renewed past its grant plus this; the renewal
        that would carry it past is refused and the lease is lost with
        ``lost_reason == "max-hold"`` (up to one TTL before grant + ``max_hold``).

        Raises :class:`~mep.NameHeld`, :class:`~mep.NameConfusable`,
        :class:`~mep.MemoryAttached` (all :class:`~mep.Held`, with ``retry_after`` and,
        for a requester of the holder's tenant, ``holder``),
        :class:`~mep.InvalidName` (``reason``), :class:`~mep.InvalidTtl`,
        :class:`~mep.InvalidRequest` (no such file: make one with :meth:`init`),
        :class:`~mep.Unavailable`, :class:`~mep.DaemonNotRunning`, ...; ``TypeError`` or
        ``ValueError`` for a wrong argument, before anything is sent.
        """
        body = _attach_body(name, path, ttl, wait, bind, labels, max_hold)
        wait = body.get("wait_seconds")
        sock_path, origin = self.resolve_socket()
        conn = _http.EventConnection.open(sock_path, origin, timeout=min(self.timeout, 10.0))
        lease = Lease(self, conn, float(body.get("ttl_seconds") or 30))
        try:
            sent = time.monotonic()
            resp = _http.request(sock_path, origin, "POST", "/v1/attach", body, self.timeout + (wait or 0.0))
            _http.raise_for(resp, "/v1/attach")
            info = LeaseInfo.from_json(resp.json_object())
            # After a wait the grant is no earlier than the request plus this: the local
            # deadline counts from there (else a wait longer than the TTL is a lost lease).
            after = info.raw.get("granted_after_ms")
            if isinstance(after, int) and not isinstance(after, bool) and after > 0:
                sent += after / 1000.0
        except BaseException:
            lease._abort()
            raise
        lease._set_attached(info, sent)
        return lease

    def lease(self, name: str, path: PathLike, ttl: Optional[int] = 30, wait: Optional[float] = None, *,
              bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
              max_hold: Optional[int] = None) -> LeaseContext:
        """A context manager that acquires on entry (see :meth:`acquire`) and releases on
        exit: ``with client.lease("My Agent", "memory.uai") as lease: ...``."""
        body = _attach_body(name, path, ttl, wait, bind, labels, max_hold)  # wrong arguments raise here, not on entry
        # The labels as checked now: a mapping the caller changes before entry changes nothing.
        return LeaseContext(self, name, path, ttl, wait, bind, labels=body.get("labels"), max_hold=max_hold)

    def attach(self, name: str, path: PathLike, *, ttl: Optional[int] = None, wait: Optional[float] = None,
               bind: str = "pid", labels: Optional[Mapping[str, str]] = None,
               max_hold: Optional[int] = None) -> LeaseInfo:
        """The bare ``POST /v1/attach`` (no event stream, no loss tracking): prefer
        :meth:`acquire`, which takes the same arguments. With ``bind="pid"`` the lease is
        bound to this process."""
        return self._run(_calls.attach(_attach_body(name, path, ttl, wait, bind, labels, max_hold)))

    def detach(self, name: str, lease_id: Optional[str] = None) -> Optional[MepError]:
        """``POST /v1/detach``: release the daemon's lease on ``name`` (display or canonical
        name); :class:`~mep.LeaseNotFound` if it holds none. With ``lease_id``, only that
        lease: not one another agent was granted under the name after this one ended.

        Returns None when the control plane confirmed the release. Otherwise the daemon
        still ended the lease here, but the control plane may hold the name until the lease
        expires there: the return value is the control plane's problem (not raised), e.g.
        :class:`~mep.Unavailable` or :class:`~mep.LeaseExpired` (``mep release`` exits 5 or 4)."""
        resp = self._request("POST", "/v1/detach", _detach_body(name, lease_id))
        _http.raise_for(resp, "/v1/detach")
        return _http.release_problem(resp)

    def leases(self) -> List[LeaseInfo]:
        """Every lease the daemon keeps (``GET /v1/leases``), lost ones included."""
        return self._run(_calls.leases())

    def status(self) -> List[LeaseInfo]:
        """Same as :meth:`leases` (what ``mep status`` shows)."""
        return self.leases()

    def get_lease(self, name: str) -> LeaseInfo:
        """``GET /v1/leases/{name}``; :class:`~mep.LeaseNotFound` if the daemon holds none."""
        return self._run(_calls.get_lease(name))

    def verify(self, name: str) -> VerifyResult:
        """``POST /v1/verify``: the control plane confirms the daemon's lease on ``name`` is
        current; :class:`~mep.StaleFence`, :class:`~mep.LeaseExpired`,
        :class:`~mep.LeaseNotFound`, :class:`~mep.Unavailable` otherwise.
        :meth:`Lease.verify` also marks a lease lost on 409/410."""
        return self._run(_calls.verify(name))

    def sync(self, name: str, *, timeout: Optional[float] = None) -> SyncResult:
        """``POST /v1/sync``: upload the memory file of the lease on ``name`` to the data
        plane under its token (see :meth:`Lease.sync`). ``timeout``: seconds to wait for
        the daemon's answer; None (default) waits as long as the upload takes."""
        return self._run(_calls.sync(name, _transfer_timeout(timeout)))

    def fetch(self, memory_instance_id: str, path: PathLike, *, timeout: Optional[float] = None) -> FetchResult:
        """``POST /v1/fetch``: download the memory's latest stored object into the new file
        ``path`` (it must not exist) and bind that file to the memory's identity — how a
        memory moves to another host. :class:`~mep.MemoryNotFound` if nothing is stored;
        :class:`~mep.StoreNotConfigured`, :class:`~mep.StoreUnavailable`.

        ``timeout``: seconds to wait for the daemon's answer (:class:`~mep.DaemonTimeout`
        after that); None (default) sets no limit — the daemon answers only once the
        download is done, and gives up itself on a transfer that stalls (no progress for 30 s)."""
        return self._run(_calls.fetch(memory_instance_id, path, _transfer_timeout(timeout)))

    def events(self) -> EventStream:
        """Follow the daemon's event stream (every lease of the daemon: filter on
        ``canonical_name``). The stream ends when the daemon stops or restarts."""
        path, origin = self.resolve_socket()
        return EventStream(_http.EventConnection.open(path, origin, timeout=min(self.timeout, 10.0)))

    # ---- memories ----------------------------------------------------------------------
    def init(self, path: PathLike) -> MemoryIdentity:
        """``POST /v1/init``: create the new, empty memory file ``path`` with a fresh
        identity (:class:`~mep.InvalidRequest` if it exists)."""
        return self._run(_calls.init(path))

    def branch(self, path: PathLike, new_path: PathLike) -> BranchResult:
        """``POST /v1/branch``: copy the held memory at ``path`` to ``new_path`` as a new
        identity whose lineage records the parent and its token. Needs a live lease on
        ``path``'s memory (:class:`~mep.LeaseNotFound` / :class:`~mep.LeaseExpired`)."""
        return self._run(_calls.branch(path, new_path))

    def identify(self, path: PathLike) -> MemoryIdentity:
        """``GET /v1/identify``: the identity of the memory file ``path``."""
        return self._run(_calls.identify(path))

    def lineage(self, path_or_id: PathLike) -> Lineage:
        """``GET /v1/lineage``: ancestors and children of a memory, given as a file path or
        as a memory id (a UUID that is not the name of an existing file)."""
        return self._run(_calls.lineage(path_or_id))

    def health(self) -> Health:
        """``GET /healthz``."""
        return self._run(_calls.health())

    # ---- names -------------------------------------------------------------------------
    def canonicalize(self, name: str) -> CanonicalName:
        """The canonical form, skeleton and scripts of an agent name, or
        :class:`~mep.InvalidName` with ``reason``. The daemon has no endpoint for this, so
        it runs the offline ``mep canonicalize --json`` CLI (``mep_bin``, ``$MEP_BIN`` or
        ``mep`` on PATH; :class:`~mep.CliNotFound` if there is none) — the same code the
        daemon and the control plane use."""
        _args.text(name, "name")
        return canonicalize_with_cli(self.mep_bin or _config.find_mep_bin(), name)
