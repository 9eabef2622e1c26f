"""mepd's socket API as calls, without I/O: what each request of :class:`mep.Client` and
:class:`mep.aio.AsyncClient` sends and how its answer is read. The two faces only carry a
:class:`Call` over the socket (blocking or with asyncio), so a route, a body, an argument
check or a decoder is written once, here. Every argument is checked when the call is built,
before anything is sent."""
from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from . import _args, _http
from .errors import MepError, ProtocolError
from .types import BranchResult, FetchResult, Health, LeaseInfo, Lineage, MemoryIdentity, SyncResult, VerifyResult

PathLike = Union[str, "os.PathLike[str]"]

_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


@dataclass(frozen=True)
class Call:
    """One request and how to read its answer (a JSON object)."""

    method: str
    target: str
    body: Optional[Dict[str, Any]]
    decode: Callable[[Dict[str, Any]], Any]
    #: Seconds for the answer; None: the client's timeout plus :attr:`extra`; ``inf``: none.
    timeout: Optional[float] = None
    #: Seconds added to the client's timeout (how long an attach may wait for a held name).
    extra: float = 0.0

    def timeout_for(self, client_timeout: float) -> float:
        return self.timeout if self.timeout is not None else client_timeout + self.extra


def abs_path(path: PathLike, arg: str = "path") -> str:
    """A file path as mepd takes it: absolute, from this process's working directory."""
    return _args.path(path, arg)


def attach_body(name: str, path: PathLike, ttl: Optional[int], wait: Optional[float], bind: str,
                labels: Optional[Mapping[str, str]] = None, max_hold: Optional[int] = None) -> Dict[str, Any]:
    """The body of ``POST /v1/attach``, every argument checked."""
    body: Dict[str, Any] = {"name": _args.text(name, "name"), "path": abs_path(path), "bind": _args.bind(bind)}
    t = _args.ttl(ttl)
    if t is not None:
        body["ttl_seconds"] = t
    w = _args.wait(wait)
    if w is not None:
        body["wait_seconds"] = w
    lab = _args.labels(labels)
    if lab:  # none or empty: not sent (a mepd that predates labels takes the attach)
        body["labels"] = lab
    h = _args.max_hold(max_hold)
    if h is not None:
        body["max_hold_seconds"] = h
    return body


def detach_body(name: str, lease_id: Optional[str]) -> Dict[str, Any]:
    """The body of ``POST /v1/detach``."""
    body: Dict[str, Any] = {"name": _args.text(name, "name")}
    if lease_id is not None:
        body["lease_id"] = _args.text(lease_id, "lease_id")
    return body


def lineage_query(path_or_id: PathLike) -> str:
    """The query of ``GET /v1/lineage`` for a path or a memory id (a UUID that is not the
    name of an existing file)."""
    s = _args.path_text(path_or_id, "path_or_id")
    if _UUID_RE.match(s) and not os.path.exists(s):
        return "id=" + urllib.parse.quote(s, safe="")
    return "path=" + urllib.parse.quote(abs_path(s, "path_or_id"), safe="")


def _lease_list(doc: Dict[str, Any]) -> List[LeaseInfo]:
    items = doc.get("leases")
    if not isinstance(items, list):
        raise ProtocolError("GET /v1/leases answered without a leases array")
    return [LeaseInfo.from_json(o) for o in items if isinstance(o, dict)]


def attach(body: Dict[str, Any]) -> Call:
    """``POST /v1/attach`` with a body from :func:`attach_body`; it may wait its
    ``wait_seconds`` longer than the client's timeout."""
    return Call("POST", "/v1/attach", body, LeaseInfo.from_json, extra=float(body.get("wait_seconds", 0)))


def leases() -> Call:
    return Call("GET", "/v1/leases", None, _lease_list)


def get_lease(name: str) -> Call:
    return Call("GET", "/v1/leases/" + urllib.parse.quote(_args.text(name, "name"), safe=""), None,
                LeaseInfo.from_json)


def verify(name: str) -> Call:
    return Call("POST", "/v1/verify", {"name": _args.text(name, "name")}, VerifyResult.from_json)


def sync(name: str, timeout: float) -> Call:
    """``timeout``: as :func:`mep.lease._transfer_timeout` gives it (``inf``: none)."""
    return Call("POST", "/v1/sync", {"name": _args.text(name, "name")}, SyncResult.from_json, timeout=timeout)


def fetch(memory_instance_id: str, path: PathLike, timeout: float) -> Call:
    body = {"memory_instance_id": _args.text(memory_instance_id, "memory_instance_id"), "path": abs_path(path)}
    return Call("POST", "/v1/fetch", body, FetchResult.from_json, timeout=timeout)


def init(path: PathLike) -> Call:
    return Call("POST", "/v1/init", {"path": abs_path(path)}, MemoryIdentity.from_json)


def branch(path: PathLike, new_path: PathLike) -> Call:
    return Call("POST", "/v1/branch", {"path": abs_path(path), "new_path": abs_path(new_path, "new_path")},
                BranchResult.from_json)


def identify(path: PathLike) -> Call:
    return Call("GET", "/v1/identify?path=" + urllib.parse.quote(abs_path(path), safe=""), None,
                MemoryIdentity.from_json)


def lineage(path_or_id: PathLike) -> Call:
    return Call("GET", "/v1/lineage?" + lineage_query(path_or_id), None, Lineage.from_json)


def health() -> Call:
    return Call("GET", "/healthz", None, Health.from_json)


# ---- answers about a held lease, judged once for both faces' lease objects -----------------

#: The codes that say a held lease is no longer the caller's: it is lost. Decided on the
#: problem's code, never on its status (a 404 from a route an older mepd lacks is not a loss).
LOST_CODES = frozenset({"stale-fence", "lease-expired", "lease-not-found"})


def lost_by(resp: _http.Response) -> Optional[str]:
    """The code of an answer about a held lease that means it is lost; None for a 2xx answer
    and for a refusal that says nothing of the lease (busy, unreachable, invalid)."""
    if 200 <= resp.status < 300:
        return None
    code = resp.error().code
    return code if code in LOST_CODES else None


def read_recheck(resp: _http.Response) -> Tuple[bool, Optional[LeaseInfo]]:
    """The answer of GET /v1/leases/{name} asked after the event stream came back:
    (True, info) mepd holds the lease as ``info``; (True, None) it holds none of that name
    (``lease-not-found``); (False, None) no answer to go by: ask again later."""
    if 200 <= resp.status < 300:
        try:
            return True, LeaseInfo.from_json(resp.json_object())
        except MepError:
            return False, None
    if resp.error().code == "lease-not-found":
        return True, None
    return False, None
