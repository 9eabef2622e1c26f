"""HTTP/1.1 over the daemon's Unix socket, hand-rolled on :mod:`socket` (one connection per
request, ``Connection: close``, like the CLI), plus the NDJSON event stream.

The framing code (:func:`build_request`, :class:`ResponseParser`) has no I/O, so the
asyncio client (:mod:`mep.aio`) shares it.
"""
from __future__ import annotations

import json
import select
import socket
import time
from typing import Any, Dict, List, Optional, Tuple

from .errors import DaemonNotRunning, DaemonTimeout, MepError, NotSupported, ProtocolError, Unavailable, error_for_problem

# Bounds on what the SDK accepts from the daemon.
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_EVENT_LINE_BYTES = 1024 * 1024

_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)

#: Endpoints a daemon older than the API notes lacks: a ``404 not-found`` from them means
#: "this mepd does not have it", not "no such lease".
NEWER_ENDPOINTS = ("/v1/verify", "/v1/sync", "/v1/fetch")

#: Seconds to connect and send a request when the answer itself may take any time.
DEFAULT_CONNECT_TIMEOUT_S = 30.0


def build_request(method: str, target: str, body: Optional[Any] = None) -> bytes:
    """The bytes of one request; ``body`` (if not None) is sent as JSON."""
    head = "%s %s HTTP/1.1\r\nHost: mepd\r\nConnection: close\r\nAccept: application/json\r\n" % (method, target)
    data = b""
    if body is not None:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        head += "Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data)
    elif method in ("POST", "PUT", "PATCH"):
        head += "Content-Length: 0\r\n"
    return head.encode("latin-1") + b"\r\n" + data


class Response:
    """One answer: ``status``, lower-cased ``headers``, ``body`` bytes."""

    def __init__(self, status: int, headers: Dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        """The body decoded as JSON; :class:`~mep.ProtocolError` if it is not JSON."""
        try:
            return json.loads(self.body.decode("utf-8")) if self.body else None
        except (UnicodeDecodeError, ValueError):
            raise ProtocolError("mepd answered %d with a body that is not JSON: %r" % (self.status, self.body[:200])) from None

    def json_object(self) -> Dict[str, Any]:
        """The body as a JSON object; :class:`~mep.ProtocolError` otherwise."""
        doc = self.json()
        if not isinstance(doc, dict):
            raise ProtocolError("mepd answered %d without a JSON object: %r" % (self.status, self.body[:200]))
        return doc

    def error(self) -> MepError:
        """The exception for an error answer (4xx/5xx)."""
        return error_for_problem(self.status, self.body, self.headers)

    def object_or_none(self) -> Optional[Dict[str, Any]]:
        """The body as a JSON object, or None when it is not one."""
        try:
            doc = self.json()
        except ProtocolError:
            return None
        return doc if isinstance(doc, dict) else None

    def refused_field(self, field: str) -> bool:
        """Whether this is a 400 naming ``field`` as unknown (a mepd older than the field)."""
        doc = self.object_or_none() if self.status == 400 else None
        return doc is not None and field in (doc.get("unknown_fields") or [])


def parse_head(head: bytes) -> Tuple[int, Dict[str, str]]:
    """Status and lower-cased headers of a response head (without the blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError("mepd did not answer HTTP: %r" % lines[0][:200])
    headers: Dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        k, sep, v = line.partition(":")
        if not sep:
            raise ProtocolError("malformed header line from mepd: %r" % line[:200])
        k = k.strip().lower()
        v = v.strip()
        headers[k] = headers[k] + ", " + v if k in headers else v
    return int(parts[1]), headers


class ResponseParser:
    """Incremental parser of one response: :meth:`feed` bytes until :attr:`done`; call
    :meth:`finish` at EOF. Understands Content-Length, chunked and read-until-close."""

    def __init__(self) -> None:
        self._buf = b""
        self.status = 0
        self.headers: Dict[str, str] = {}
        self._head_done = False
        self._length: Optional[int] = None
        self._chunked = False
        self.body = b""
        self.done = False

    def feed(self, data: bytes) -> None:
        """Add bytes read from the connection."""
        self._buf += data
        if not self._head_done:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > MAX_HEADER_BYTES:
                    raise ProtocolError("mepd's response head is too large")
                return
            self.status, self.headers = parse_head(self._buf[:end])
            self._buf = self._buf[end + 4 :]
            self._head_done = True
            if 100 <= self.status < 200:  # an interim response: the real one follows
                rest = self._buf
                self.__init__()  # type: ignore[misc]
                return self.feed(rest)
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                self._chunked = True
            elif "content-length" in self.headers:
                try:
                    self._length = int(self.headers["content-length"])
                except ValueError:
                    raise ProtocolError("bad Content-Length from mepd: %r" % self.headers["content-length"]) from None
            elif self.status in (204, 304):
                self._length = 0
        if self._length is not None:
            if len(self._buf) >= self._length:
                self.body = self._buf[: self._length]
                self.done = True
        elif self._chunked:
            self._parse_chunks()
        if len(self._buf) > MAX_BODY_BYTES:
            raise ProtocolError("mepd's response body is too large")

    def _parse_chunks(self) -> None:
        out = b""
        pos = 0
        buf = self._buf
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                return
            size_text = buf[pos:nl].split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise ProtocolError("bad chunk size from mepd: %r" % size_text[:20]) from None
            if size == 0:
                if buf.find(b"\r\n", nl + 2) < 0:
                    return
                self.body = out
                self.done = True
                return
            if len(buf) < nl + 2 + size + 2:
                return
            out += buf[nl + 2 : nl + 2 + size]
            pos = nl + 2 + size + 2

    def finish(self) -> None:
        """The peer closed: a read-until-close body ends here; anything else is cut short."""
        if self.done:
            return
        if not self._head_done:
            if not self._buf:
                raise Unavailable("mepd closed the connection without answering")
            raise ProtocolError("mepd closed the connection in the middle of its response head")
        if self._length is None and not self._chunked:
            self.body = self._buf
            self.done = True
            return
        raise ProtocolError("mepd closed the connection in the middle of its response")

    def response(self) -> Response:
        """The parsed response (after :attr:`done`)."""
        return Response(self.status, self.headers, self.body)


def not_running(socket_path: str, origin: str, err: BaseException) -> DaemonNotRunning:
    """The error for a socket that does not accept connections."""
    why = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return DaemonNotRunning(
        "cannot reach mepd at %s (%s; the path came from %s): start it with 'mepd' or "
        "'systemctl --user start mepd.socket', or point $MEP_SOCKET at its socket" % (socket_path, why, origin),
        retry_after=1.0,
    )


def connect(socket_path: str, origin: str, timeout: float) -> socket.socket:
    """A connected AF_UNIX stream socket; :class:`~mep.DaemonNotRunning` if nobody listens."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(socket_path)
    except socket.timeout:
        s.close()
        raise DaemonTimeout("mepd at %s did not accept the connection within %.0f s" % (socket_path, timeout)) from None
    except OSError as e:
        s.close()
        raise not_running(socket_path, origin, e) from None
    return s


def request(
    socket_path: str,
    origin: str,
    method: str,
    target: str,
    body: Optional[Any] = None,
    timeout: Optional[float] = 30.0,
    connect_timeout: Optional[float] = None,
) -> Response:
    """One request/response on a fresh connection, all of it within ``timeout`` seconds;
    ``timeout=None`` sets no limit on waiting for the answer (for uploads and downloads,
    which the daemon answers only once done), while connecting and sending the request
    stay bounded by ``connect_timeout`` (default: ``timeout``, else 30 s).
    Raises :class:`~mep.DaemonNotRunning`, :class:`~mep.DaemonTimeout` or
    :class:`~mep.ProtocolError`; an HTTP error status is returned, not raised."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if connect_timeout is None:
        connect_timeout = timeout if timeout is not None else DEFAULT_CONNECT_TIMEOUT_S
    s = connect(socket_path, origin, connect_timeout)
    try:
        try:
            s.sendall(build_request(method, target, body), _SEND_FLAGS)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a daemon that refuses the peer answers without reading: read the answer
        except socket.timeout:
            raise DaemonTimeout("mepd at %s did not take the request within %.0f s" % (socket_path, connect_timeout)) from None
        parser = ResponseParser()
        while not parser.done:
            if deadline is None:
                s.settimeout(None)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonTimeout("mepd at %s did not answer %s %s within %g s"
                                        % (socket_path, method, target, timeout))
                s.settimeout(left)
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                parser.finish()
                break
            parser.feed(data)
        return parser.response()
    finally:
        s.close()


def release_problem(resp: Response) -> Optional[MepError]:
    """What a ``200`` to ``POST /v1/detach`` says beside ``released``: the control plane's
    problem when it did not confirm the release (None for ``204``, a confirmed release)."""
    doc = resp.object_or_none() if resp.status == 200 else None
    cp = doc.get("control_plane") if doc is not None else None
    if not isinstance(cp, dict):
        return None
    status = cp.get("status") if isinstance(cp.get("status"), int) else 503
    return error_for_problem(status, json.dumps(cp).encode("utf-8"))


def raise_for(resp: Response, target: str) -> None:
    """Raise the answer's problem, unless it is a success (2xx). A ``404 not-found`` from an
    endpoint older daemons lack becomes :class:`~mep.NotSupported`."""
    if 200 <= resp.status < 300:
        return
    err = resp.error()
    path = target.split("?", 1)[0]
    if err.code == "not-found" and path in NEWER_ENDPOINTS:
        raise NotSupported(
            "this mepd has no %s endpoint (it predates it): upgrade mepd" % path,
            code=err.code, status=err.status, instance=err.instance, extensions=err.extensions,
        )
    if err.code == "invalid-request" and "wait_seconds" in (err.unknown_fields or []):
        raise NotSupported(
            "this mepd does not know wait_seconds (it predates waiting for a held name): upgrade mepd, or attach with wait=None",
            code=err.code, status=err.status, instance=err.instance, extensions=err.extensions,
        )
    newer = [f for f in ("labels", "max_hold_seconds") if f in (err.unknown_fields or [])]
    if err.code == "invalid-request" and newer:
        raise NotSupported(
            "this mepd does not know %s (it predates holder labels and max hold): upgrade mepd, or attach "
            "without labels and max_hold" % " and ".join(newer),
            code=err.code, status=err.status, instance=err.instance, extensions=err.extensions,
        )
    raise err


class EventConnection:
    """A connection reading ``GET /v1/events``: :meth:`open` sends the request and reads the
    head (so the daemon has subscribed it before :meth:`open` returns); :meth:`read_lines`
    returns the complete lines that have arrived, or None once the stream has ended."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.closed = False

    @classmethod
    def open(cls, socket_path: str, origin: str, timeout: float = 10.0) -> "EventConnection":
        """Connect and subscribe; raises like :func:`request`, or the daemon's problem."""
        deadline = time.monotonic() + timeout
        s = connect(socket_path, origin, timeout)
        try:
            s.sendall(build_request("GET", "/v1/events"), _SEND_FLAGS)
            buf = b""
            while b"\r\n\r\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonTimeout("mepd at %s did not start the event stream within %.0f s" % (socket_path, timeout))
                s.settimeout(left)
                try:
                    data = s.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    raise Unavailable("mepd closed the event stream before its head")
                buf += data
                if len(buf) > MAX_HEADER_BYTES:
                    raise ProtocolError("mepd's event stream head is too large")
            end = buf.index(b"\r\n\r\n")
            status, headers = parse_head(buf[:end])
            rest = buf[end + 4 :]
            if status != 200:
                parser = ResponseParser()
                parser.feed(buf)
                while not parser.done:
                    s.settimeout(max(0.1, deadline - time.monotonic()))
                    data = s.recv(65536)
                    if not data:
                        parser.finish()
                        break
                    parser.feed(data)
                raise parser.response().error()
        except (OSError, MepError) as e:
            s.close()
            if isinstance(e, MepError):
                raise
            if isinstance(e, socket.timeout):
                raise DaemonTimeout("mepd at %s did not start the event stream" % socket_path) from None
            raise Unavailable("the event stream from mepd at %s failed: %s" % (socket_path, e)) from None
        s.setblocking(False)
        conn = cls(s)
        conn._buf = rest
        return conn

    def fileno(self) -> int:
        """The socket's descriptor (for ``select``)."""
        return self.sock.fileno()

    def pending_lines(self) -> List[bytes]:
        """Complete lines already buffered (without reading)."""
        out: List[bytes] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line = self._buf[:nl].strip()
            self._buf = self._buf[nl + 1 :]
            if line:
                out.append(line)
        if len(self._buf) > MAX_EVENT_LINE_BYTES:
            raise ProtocolError("an event line from mepd is too long")
        return out

    def read_lines(self, timeout: float) -> Optional[List[bytes]]:
        """Wait up to ``timeout`` seconds for data; the complete lines (maybe none), or
        None when the stream has ended (the daemon stopped or closed it)."""
        lines = self.pending_lines()
        if lines:
            return lines
        if self.closed:
            return None
        try:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        except (OSError, ValueError):
            self.close()
            return None
        if not ready:
            return []
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            rest = self._buf.strip()
            self._buf = b""
            return [rest] if rest else None
        self._buf += data
        return self.pending_lines()

    def close(self) -> None:
        """Close the connection (the daemon unsubscribes it)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
