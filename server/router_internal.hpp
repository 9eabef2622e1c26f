// What the control plane's HTTP edge shares between router.cpp (the route table, dispatch
// and the lease operations' handlers) and router_reads.cpp (the reads', metrics' and health
// handlers): a request's Call, its Reply, and decoding, authentication and encoding helpers.
// Included by those two files only.
#pragma once
#include "mep/router.hpp"

#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/expected.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/rows.hpp"
#include "mep/uuid.hpp"
#include "mep/utf8.hpp"

#include <boost/beast/http.hpp>
#include <boost/url/parse.hpp>
#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <memory>
#include <mutex>

namespace mep::server::router_detail {
namespace bhttp = boost::beast::http;
namespace wire = lease::wire;
using json::Need;

inline constexpr std::int64_t k_any_ttl = std::int64_t{1} << 40; // range checked by the store (422)

// An HTTP answer before it becomes a response.
struct Reply {
  int status = 200;
  std::string body;     ///< JSON text; empty for 204
  bool problem = false; ///< body is application/problem+json
  std::optional<int> retry_after_s;
  bool replayed = false;
  std::string allow; ///< for a 405: the methods the path accepts
  std::vector<std::pair<std::string, std::string>> headers;
};

// Calls fn(segment) for each '/'-separated segment of a pattern ("/a/{x}" → "a", "{x}").
template <class F>
inline bool each_segment(std::string_view pattern, F&& fn) {
  for (std::size_t i = 1; i <= pattern.size();) {
    std::size_t j = pattern.find('/', i);
    if (j == std::string_view::npos) j = pattern.size();
    if (!fn(pattern.substr(i, j - i))) return false;
    i = j + 1;
  }
  return true;
}

inline bool is_param(std::string_view seg) { return seg.size() > 2 && seg.front() == '{'; }

// Whether a pattern matches the path's segments (no allocation); `params`, when given, gets
// the segments its "{x}" parts matched.
inline bool match(std::string_view pattern, const std::vector<std::string>& segs,
                  std::vector<std::string>* params = nullptr) {
  std::size_t n = 0;
  bool ok = each_segment(pattern, [&](std::string_view seg) {
    if (n >= segs.size()) return false;
    const std::string& s = segs[n++];
    return is_param(seg) ? !s.empty() : seg == s;
  });
  if (!ok || n != segs.size()) return false;
  if (params) {
    params->clear();
    n = 0;
    each_segment(pattern, [&](std::string_view seg) {
      if (is_param(seg)) params->push_back(segs[n]);
      ++n;
      return true;
    });
  }
  return true;
}

// Everything one request carries through the handler chain.
struct Route;
struct Call {
  HttpRequest req;
  Peer peer;
  Send send;
  Ctx ctx;
  const Route* route = nullptr;
  std::vector<std::string> params;
  boost::urls::params_view query;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::string route_label = "unmatched";
  int fd = -1; // the client's socket, watched while a claim waits
};
using CallPtr = std::shared_ptr<Call>;

enum class Auth { none, lease, admin, metrics };
enum class Idem { none, required };
enum class Gate { open, migration };          // closed while a legacy migration is in progress (SPEC §10)
enum class Priority { normal, keeps_leases }; // renewals and releases get the rate limit's reserve
enum class Metric { none, claims, renewals }; // mep_claims_total, mep_lease_renewal_latency_seconds

// What the handlers call: the lease service, or (health, readiness, metrics) the store's
// health. A handler names the one it needs by its parameter; the route table adapts it
// (by_service, by_health), so a handler is written and tested against that role alone.
struct Backend {
  LeaseService& svc;
  StoreHealth& health;
};
using HandlerFn = void (*)(const CallPtr&, Backend&);
template <void (*F)(const CallPtr&, LeaseService&)>
void by_service(const CallPtr& c, Backend& b) {
  F(c, b.svc);
}
template <void (*F)(const CallPtr&, StoreHealth&)>
void by_health(const CallPtr& c, Backend& b) {
  F(c, b.health);
}

struct Route {
  bhttp::verb method;
  std::string_view pattern; // segments; "{x}" matches one segment; also the metric label
  Auth auth;
  Idem idem;
  Gate gate;
  Priority priority;
  std::size_t body_limit;
  Metric metric;
  HandlerFn handler;
};

inline HttpResponse make_response(const Call& c, const Reply& r) {
  HttpResponse res{static_cast<bhttp::status>(r.status), c.req.version()};
  res.set(bhttp::field::server, "mep");
  res.set("X-Request-Id", c.ctx.request_id);
  res.set(bhttp::field::cache_control, "no-store");
  if (!r.body.empty() || r.status != 204) {
    res.set(bhttp::field::content_type, r.problem ? "application/problem+json" : "application/json");
    res.body() = r.body;
  }
  if (r.retry_after_s) res.set(bhttp::field::retry_after, std::to_string(*r.retry_after_s));
  if (r.replayed) res.set("Idempotent-Replayed", "true");
  if (r.status == 401) res.set(bhttp::field::www_authenticate, "Bearer realm=\"mep\"");
  if (!r.allow.empty()) res.set(bhttp::field::allow, r.allow);
  for (const auto& [k, v] : r.headers) res.set(k, v);
  res.keep_alive(c.req.keep_alive());
  res.prepare_payload();
  return res;
}

// `outcome`: the mep_claims_total label of a claim's answer.
inline void finish(const CallPtr& c, Reply r, std::string_view outcome = {}) {
  auto& m = Metrics::global();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - c->start).count();
  std::string labels = "route=\"" + c->route_label + "\",code=\"" + std::to_string(r.status) + "\"";
  m.observe("mep_http_request_duration_seconds", labels, secs);
  if (c->route && c->route->metric == Metric::claims)
    m.inc("mep_claims_total",
          "outcome=\"" + (outcome.empty() ? std::to_string(r.status) : std::string(outcome)) + "\"");
  if (c->route && c->route->metric == Metric::renewals) m.observe("mep_lease_renewal_latency_seconds", "", secs);
  if (r.status >= 500)
    log::warn("request {} {} -> {}", c->ctx.request_id, c->route_label, r.status);
  else
    log::debug("request {} {} -> {} in {:.2f} ms", c->ctx.request_id, c->route_label, r.status, secs * 1000);
  c->send(make_response(*c, r));
}

inline Reply problem_reply(Problem p, const std::string& request_id) {
  if (p.instance.empty()) p.instance = request_id; // a replayed problem keeps its first request's
  Reply r;
  r.status = p.status();
  r.body = json::dump(p.to_json());
  r.problem = true;
  r.retry_after_s = p.retry_after_s;
  // Every 503 says when to come back (a store that forgot to is answered for).
  if (r.status == 503 && !r.retry_after_s) r.retry_after_s = 1;
  return r;
}

inline void fail(const CallPtr& c, Problem p) {
  const std::string_view label = p.slug();
  finish(c, problem_reply(std::move(p), c->ctx.request_id), label);
}

// ---- encoding outcomes ----------------------------------------------------------------------

template <class T>
inline Reply encode(const CallPtr& c, const Outcome<T>& o, int status) {
  if (!o.ok()) {
    Reply r = problem_reply(o.value.error(), c->ctx.request_id);
    r.replayed = o.replayed;
    return r;
  }
  Reply r;
  r.status = status;
  r.replayed = o.replayed;
  if constexpr (!std::is_same_v<T, Released> && !std::is_same_v<T, Revoked>)
    r.body = json::dump(wire::to_json(*o.value));
  return r;
}

// The answer for an outcome whose success has one status (a template argument: the
// closure then holds only the call, and fits in std::function without an allocation).
template <class T, int Status>
Then<T> answer(CallPtr c) {
  return [c = std::move(c)](Outcome<T> o) { finish(c, encode(c, o, Status)); };
}

// A created resource is 201 the first time and 200 when it existed (or is replayed).
template <class T>
Then<T> answer_created(CallPtr c) {
  return [c = std::move(c)](Outcome<T> o) { finish(c, encode(c, o, o.ok() && o.value->created ? 201 : 200)); };
}

// The header's value (the last one), and whether it came more than once. `Key`: a
// bhttp::field or a header name.
template <class Key>
std::optional<std::string> header_once(const bhttp::fields& req, Key key, bool& doubled) {
  auto range = req.equal_range(key);
  std::optional<std::string> value;
  doubled = false;
  for (auto it = range.first; it != range.second; ++it) {
    if (value) doubled = true;
    value = std::string(it->value());
  }
  return value;
}

// The bearer token of a request (SPEC §6: checked before anything else): its tenant and
// scopes, or the problem to answer (401; 503 when the lookup itself failed).
inline expected<AuthInfo, Problem> check_bearer(const bhttp::fields& fields, TokenStore& store,
                                                RateLimiter& audit_budget) {
  bool doubled = false;
  auto h = header_once(fields, bhttp::field::authorization, doubled);
  auto unauth = [](std::string detail) {
    Metrics::global().inc("mep_auth_failures_total");
    return make_unexpected(Problem(Code::unauthenticated, std::move(detail)));
  };
  if (!h) return unauth("an Authorization: Bearer token is required");
  if (doubled) return unauth("more than one Authorization header");
  auto bearer = http::bearer_token(*h);
  if (!bearer) return unauth("the Authorization header must be 'Bearer <token>'");
  std::string_view v = *bearer;
  if (v.empty() || v.size() > 512) return unauth("invalid bearer token");
  std::optional<AuthInfo> auth;
  try {
    auth = store.authenticate(sha256_hex(v));
  } catch (const std::exception& e) {
    log::error("authentication lookup failed: {}", e.what());
    return make_unexpected(db_unavailable());
  }
  if (!auth) {
    if (audit_budget.acquire("auth-failed") == 0) store.audit_auth_failure("");
    return unauth("unknown or revoked bearer token");
  }
  return *auth;
}

inline bool authenticate(const CallPtr& c, TokenStore& store, RateLimiter& audit_budget) {
  auto auth = check_bearer(c->req, store, audit_budget);
  if (!auth) {
    fail(c, std::move(auth.error()));
    return false;
  }
  c->ctx.auth = std::move(*auth);
  return true;
}

// Decodes the JSON body of a POST: media type, size (the parser enforces 16 KiB), syntax.
inline std::optional<boost::json::object> body_object(const CallPtr& c, bool empty_ok) {
  if (empty_ok && c->req.body().empty()) return boost::json::object{};
  if (auto p = http::json_body_problem(c->req)) {
    fail(c, std::move(*p));
    return std::nullopt;
  }
  auto obj = json::parse_object(c->req.body());
  if (!obj) {
    fail(c, std::move(obj.error()));
    return std::nullopt;
  }
  return std::move(*obj);
}

// The request's Idempotency-Key, bound to its fingerprint; only for rows that say
// Idem::required (a handler that asks on another row is a bug, answered 500).
inline std::optional<Idempotency> idempotency(const CallPtr& c, const boost::json::object& body) {
  if (c->route->idem != Idem::required) {
    log::error("route {} reads an Idempotency-Key its row does not ask for", c->route_label);
    fail(c, Problem(Code::internal, "internal error"));
    return std::nullopt;
  }
  bool doubled = false;
  auto h = header_once(c->req, "Idempotency-Key", doubled);
  if (!h) {
    fail(c, Problem(Code::idempotency_key_missing, "this request needs an Idempotency-Key header"));
    return std::nullopt;
  }
  auto key = doubled ? std::nullopt : parse_idempotency_key(*h);
  if (!key) {
    fail(c, Problem(Code::idempotency_key_invalid, "Idempotency-Key must be 1-255 printable ASCII characters, once"));
    return std::nullopt;
  }
  return Idempotency{*key, request_fingerprint(c->req.method_string(), c->route->pattern,
                                               c->params.empty() ? "" : c->params.front(), body)};
}

inline bool finish_reader(const CallPtr& c, json::ObjectReader& r) {
  if (auto ok = r.finish(); !ok) {
    fail(c, std::move(ok.error()));
    return false;
  }
  return true;
}

// ---- router_reads.cpp: reads, metrics, health ----------------------------------------------

void on_get_lease(const CallPtr& c, LeaseService& svc);
void on_history(const CallPtr& c, LeaseService& svc);
void on_list_leases(const CallPtr& c, LeaseService& svc);
void on_get_memory(const CallPtr& c, LeaseService& svc);
void on_lineage(const CallPtr& c, LeaseService& svc);
void on_identity_map(const CallPtr& c, LeaseService& svc);
void on_metrics(const CallPtr& c, StoreHealth& health);
void on_admin_check(const CallPtr& c, LeaseService& svc);
void on_healthz(const CallPtr& c, StoreHealth& health);
void on_readyz(const CallPtr& c, StoreHealth& health);

} // namespace mep::server::router_detail
