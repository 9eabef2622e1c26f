"""A history checker for the control plane (SPEC §3, S1–S4).

Tests record every claim, renew, release, branch and verify with its request, its
response and the client's monotonic window [start, end] in which it ran; `check()` then
verifies, for the whole history:

- S3: per memory, acknowledged grants have distinct tokens, and a grant acknowledged
  before another grant started has the smaller token (tokens increase in real time);
- S4: a renew, release, branch or verify that succeeded used the memory's newest token:
  no grant with a larger token was acknowledged before that operation started;
- S1/S2: two grants to different holders on one name or one memory do not overlap: the
  later one (by server time) comes after the earlier one's last acknowledged expiry, or
  after a release of it had started that succeeded or whose outcome is unknown.

Only acknowledged outcomes are trusted; operations without an answer (a killed server)
are kept as "unknown" and constrain nothing, which is what a client can know.

Data-plane writes (kind `write`: a PUT to the store with a fencing token; kind `advance`)
are checked by `check_data(final)` (SPEC §8):

- D1: an accepted write's token is at least every token the store acknowledged (a write or
  an advance) before that write started: a lower token's bytes never become current after
  a higher token was accepted;
- D2: the store's final object for a memory carries the highest token of any accepted
  write (or of a write with no answer, which may have been applied), and its bytes are the
  bytes of a write with that token;
- D3: a write refused as stale named a current token higher than the one it presented.
"""
import threading
import time

try:
    from serverfixture import parse_rfc3339_ms
except ImportError:  # pragma: no cover - the checker is usable on its own
    parse_rfc3339_ms = None


class History:
    def __init__(self):
        self._lock = threading.Lock()
        self.ops = []

    def begin(self):
        return time.monotonic()

    def record(self, kind, start, status, *, name=None, memory=None, owner=None, token=None, body=None, data=None):
        """kind: claim | renew | release | branch | verify | write | advance; status: HTTP
        status or None (no answer); body: the parsed JSON answer (or None); data: the bytes
        a write sent."""
        op = {"kind": kind, "start": start, "end": time.monotonic(), "status": status, "name": name,
              "memory": memory, "owner": owner, "token": token, "body": body or {}, "data": data}
        with self._lock:
            self.ops.append(op)
        return op

    # ---- the checker ------------------------------------------------------------------------

    def check(self):
        """Returns a list of violations (empty when the history is consistent)."""
        ops = list(self.ops)
        bad = []
        index = {}
        grants = [o for o in ops if o["kind"] == "claim" and o["status"] == 201]
        for g in grants:
            g["granted_token"] = g["body"]["fencing_token"]
            g["memory"] = g["body"]["memory_instance_id"]
            g["name"] = g["body"]["canonical_name"]
            g["server_ms"] = _ms(g["body"]["server_time"])
            g["last_expiry_ms"] = _ms(g["body"]["expires_at"])
        by_memory = {}
        for g in grants:
            by_memory.setdefault(g["memory"], []).append(g)
        # S3 (per memory, in O(n log n): long soaks record hundreds of thousands of operations)
        for memory, gs in by_memory.items():
            tokens = [g["granted_token"] for g in gs]
            if len(tokens) != len(set(tokens)):
                bad.append(f"S3: token issued twice on memory {memory}: {sorted(tokens)}")
            for b in gs:
                a = _earliest_end_at_or_above(index, gs, "granted_token", b["granted_token"], exclude=b)
                if a is not None and a["end"] < b["start"]:
                    bad.append(f"S3: grant {a['granted_token']} acknowledged before grant "
                               f"{b['granted_token']} started on memory {memory}")
        # Renewals extend a grant's last acknowledged expiry.
        for o in ops:
            if o["kind"] == "renew" and o["status"] == 200:
                for g in by_memory.get(o["memory"], []):
                    if g["granted_token"] == o["token"]:
                        g["last_expiry_ms"] = max(g["last_expiry_ms"], _ms(o["body"]["expires_at"]))
        # S4
        for o in ops:
            ok = (o["kind"] == "renew" and o["status"] == 200) or (o["kind"] == "release" and o["status"] == 204) \
                or (o["kind"] in ("branch",) and o["status"] == 201) or (o["kind"] == "verify" and o["status"] == 200)
            if not ok or o["token"] is None:
                continue
            g = _earliest_end_at_or_above(index, by_memory.get(o["memory"], []), "granted_token", o["token"] + 1)
            if g is not None and g["end"] < o["start"]:
                bad.append(f"S4: {o['kind']} with token {o['token']} succeeded after grant "
                           f"{g['granted_token']} on memory {o['memory']} was acknowledged")
        # S1/S2
        # A release that succeeded, or whose outcome is unknown (no answer, or a 5xx such as
        # 503 after the database connection broke mid-call), may have ended the grant.
        releases = [o for o in ops if o["kind"] == "release" and (o["status"] == 204 or o["status"] is None
                                                                  or o["status"] >= 500)]

        first_release = {}  # (memory, token) -> the earliest start of such a release
        for r in releases:
            k = (r["memory"], r["token"])
            first_release[k] = min(first_release.get(k, r["start"]), r["start"])

        def ended_by_release(g, before):
            started = first_release.get((g["memory"], g["granted_token"]))
            return started is not None and started <= before

        for key in ("name", "memory"):
            groups = {}
            for g in grants:
                groups.setdefault(g[key], []).append(g)
            for k, gs in groups.items():
                gs = sorted(gs, key=lambda g: g["server_ms"])
                for a, b in zip(gs, gs[1:]):
                    same_holder = a["owner"] == b["owner"] and a["memory"] == b["memory"] and a["name"] == b["name"]
                    if same_holder:
                        continue  # a same-owner re-claim replaces the lease
                    if b["server_ms"] < a["last_expiry_ms"] and not ended_by_release(a, b["end"]):
                        bad.append(f"S{1 if key == 'name' else 2}: {key} {k} granted to two holders at once "
                                   f"(tokens {a['granted_token']} and {b['granted_token']})")
        return bad


    def check_data(self, final):
        """`final`: memory id -> (token, bytes) of the store's current object, or None.
        Returns a list of violations of D1–D3 (empty when consistent)."""
        ops = list(self.ops)
        bad = []
        index = {}
        acked = [o for o in ops if o["kind"] in ("write", "advance") and o["status"] is not None and 200 <= o["status"] < 300]
        acked_by_memory = {}
        for a in acked:
            acked_by_memory.setdefault(a["memory"], []).append(a)
        for w in (o for o in acked if o["kind"] == "write"):
            a = _earliest_end_at_or_above(index, acked_by_memory[w["memory"]], "token", w["token"] + 1)
            if a is not None and a["end"] < w["start"]:
                bad.append(f"D1: write with token {w['token']} accepted on {w['memory']} after token "
                           f"{a['token']} was acknowledged")
        for o in ops:
            if o["kind"] == "write" and o["status"] == 409:
                cur = (o["body"] or {}).get("current_token")
                if not isinstance(cur, int) or cur <= o["token"]:
                    bad.append(f"D3: a write with token {o['token']} was refused as stale with current token {cur}")
        memories = {o["memory"] for o in ops if o["kind"] == "write"}
        for m in memories:
            writes = [o for o in ops if o["kind"] == "write" and o["memory"] == m]
            possible = [o for o in writes if o["status"] is None or 200 <= o["status"] < 300]
            accepted = [o for o in writes if o["status"] is not None and 200 <= o["status"] < 300]
            cur = final.get(m)
            if not accepted:
                continue
            if cur is None:
                bad.append(f"D2: memory {m} has no object although {len(accepted)} writes were accepted")
                continue
            token, data = cur
            top = max(o["token"] for o in accepted)
            if token < top:
                bad.append(f"D2: memory {m} ends at token {token}, below the accepted token {top}")
            if not any(o["token"] == token and o.get("data") == data for o in possible):
                bad.append(f"D2: memory {m} ends with bytes that no write with token {token} sent")
        return bad


def explain(history, violation, margin_s=0.05):
    """The recorded operations around a violation, oldest first, one line each (for reading a
    failure): those on the name or memory it names, or on the memories of the grants it names,
    from just before the first of those grants to just after the last."""
    words = violation.replace("(", " ").replace(")", " ").replace(",", " ").split()
    key = words[2] if len(words) > 2 else ""
    tokens = {int(w) for w in words if w.isdigit()}
    grants = [o for o in history.ops if o["kind"] == "claim" and o["status"] == 201
              and (o.get("body") or {}).get("fencing_token") in tokens
              and key in ((o.get("body") or {}).get("canonical_name"), (o.get("body") or {}).get("memory_instance_id"))]
    if not grants:
        return ""
    lo = min(g["start"] for g in grants) - margin_s
    hi = max(g["end"] for g in grants) + margin_s
    memories = {g["body"].get("memory_instance_id") for g in grants}
    ops = [o for o in history.ops if lo <= o["start"] <= hi
           and (o.get("name") == key or o.get("memory") == key or o.get("memory") in memories)]
    ops.sort(key=lambda o: o["start"])
    lines = []
    for o in ops:
        b = o.get("body") or {}
        lines.append("%.4f-%.4f %s %s name=%s memory=%s owner=%s token=%s -> token=%s server_time=%s expires=%s code=%s"
                     % (o["start"], o["end"], o["kind"], o["status"], o.get("name"), o.get("memory"), o.get("owner"),
                        o.get("token"), b.get("fencing_token"), b.get("server_time"), b.get("expires_at"),
                        b.get("code")))
    return "\n".join(lines)


def _earliest_end_at_or_above(index, ops, key, token, exclude=None):
    """Of `ops` whose `key` is at least `token` (but `exclude`), the one acknowledged first
    (smallest end), or None. `index` (a dict the caller keeps for one check) holds each
    list's sorted order and suffix minima, so each of many queries is one binary search."""
    import bisect
    cache = index.get(id(ops))
    if cache is None:
        order = sorted(ops, key=lambda o: o[key])
        keys = [o[key] for o in order]
        # best[i], second[i]: the two smallest ends among order[i:] (the second for `exclude`).
        best, second = [None] * (len(order) + 1), [None] * (len(order) + 1)
        for i in range(len(order) - 1, -1, -1):
            o, b1, b2 = order[i], best[i + 1], second[i + 1]
            if b1 is None or o["end"] < b1["end"]:
                best[i], second[i] = o, b1
            elif b2 is None or o["end"] < b2["end"]:
                best[i], second[i] = b1, o
            else:
                best[i], second[i] = b1, b2
        cache = (ops, keys, best, second)  # ops: keeps the list (and its id) alive
        index[id(ops)] = cache
    _, keys, best, second = cache
    i = bisect.bisect_left(keys, token)
    found = best[i]
    if found is not None and found is exclude:
        found = second[i]
    return found



def _ms(text):
    if isinstance(text, int):
        return text  # already Unix milliseconds
    if parse_rfc3339_ms is not None:
        return parse_rfc3339_ms(text)
    import calendar
    date, frac = text[:19], text[20:23]
    return calendar.timegm(time.strptime(date, "%Y-%m-%dT%H:%M:%S")) * 1000 + int(frac)
