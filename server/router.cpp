// Routes and handlers of the control-plane API. Each handler: authenticate, check the
// scope and the rate limit, decode the JSON body strictly, call the Store, and turn its
// Reply into the HTTP response (headers: X-Request-Id, Retry-After, Idempotent-Replayed).
#include "mep/router.hpp"

#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/uuid.hpp"
#include "mep/utf8.hpp"
#include "mep/wire.hpp"

#include <boost/beast/http.hpp>
#include <boost/url/parse.hpp>
#include <fmt/format.h>

#include <chrono>
#include <memory>

namespace mep::server {
namespace bhttp = boost::beast::http;
using json::Need;

namespace {

constexpr std::int64_t k_max_token = (std::int64_t{1} << 62);
constexpr std::int64_t k_any_ttl = std::int64_t{1} << 40; // range checked by the store (422)

enum class Auth { none, lease, admin, metrics };
enum class Idem { none, required };

struct RouteSpec {
  bhttp::verb method;
  std::string_view pattern; // segments; "{x}" matches one segment
  Auth auth;
  Idem idem;
};

// The route table (SPEC §6). Order matters only for equal paths; the first whose
// pattern and method match wins.
constexpr RouteSpec k_routes[] = {
    {bhttp::verb::get, "/healthz", Auth::none, Idem::none},
    {bhttp::verb::get, "/readyz", Auth::none, Idem::none},
    {bhttp::verb::get, "/metrics", Auth::metrics, Idem::none},
    {bhttp::verb::post, "/v1/memories", Auth::lease, Idem::required},
    {bhttp::verb::post, "/v1/memories/branch", Auth::lease, Idem::required},
    {bhttp::verb::get, "/v1/memories/{id}", Auth::lease, Idem::none},
    {bhttp::verb::get, "/v1/memories/{id}/lineage", Auth::lease, Idem::none},
    {bhttp::verb::post, "/v1/leases", Auth::lease, Idem::required},
    {bhttp::verb::get, "/v1/leases", Auth::lease, Idem::none},
    {bhttp::verb::post, "/v1/leases/renew", Auth::lease, Idem::none},
    {bhttp::verb::post, "/v1/leases/renew-batch", Auth::lease, Idem::none},
    {bhttp::verb::post, "/v1/leases/release", Auth::lease, Idem::none},
    {bhttp::verb::get, "/v1/leases/{canonical_name}", Auth::lease, Idem::none},
    {bhttp::verb::post, "/v1/fence/verify", Auth::lease, Idem::none},
    {bhttp::verb::post, "/v1/admin/leases/revoke", Auth::admin, Idem::none},
    {bhttp::verb::get, "/v1/migration/identity-map", Auth::lease, Idem::none},
};

// Endpoints closed while a legacy migration is in progress (SPEC §10).
bool gated_by_migration(std::string_view pattern) {
  return pattern == "/v1/leases" || pattern == "/v1/leases/renew" || pattern == "/v1/leases/renew-batch" ||
         pattern == "/v1/leases/release" || pattern == "/v1/memories/branch";
}

std::vector<std::string_view> split_pattern(std::string_view p) {
  std::vector<std::string_view> out;
  std::size_t i = 1;
  while (i <= p.size()) {
    std::size_t j = p.find('/', i);
    if (j == std::string_view::npos) j = p.size();
    out.push_back(p.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

bool match(std::string_view pattern, const std::vector<std::string>& segs, std::vector<std::string>& params) {
  auto pat = split_pattern(pattern);
  if (pat.size() != segs.size()) return false;
  std::vector<std::string> found;
  for (std::size_t i = 0; i < pat.size(); ++i) {
    if (pat[i].size() > 2 && pat[i].front() == '{') {
      if (segs[i].empty()) return false;
      found.push_back(segs[i]);
    } else if (pat[i] != segs[i]) {
      return false;
    }
  }
  params = std::move(found);
  return true;
}

// Everything one request carries through the handler chain.
struct Call {
  HttpRequest req;
  Peer peer;
  Send send;
  Ctx ctx;
  const RouteSpec* route = nullptr;
  std::vector<std::string> params;
  boost::urls::params_view query;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::string route_label = "unmatched";
  int fd = -1; // the client's socket, watched while a claim waits
};
using CallPtr = std::shared_ptr<Call>;

HttpResponse make_response(const Call& c, const Reply& r) {
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
  res.keep_alive(c.req.keep_alive());
  res.prepare_payload();
  return res;
}

using ExtraHeaders = std::vector<std::pair<std::string, std::string>>;

void finish(const CallPtr& c, Reply r, const ExtraHeaders& extra = {}) {
  auto& m = Metrics::global();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - c->start).count();
  std::string labels = "route=\"" + c->route_label + "\",code=\"" + std::to_string(r.status) + "\"";
  m.observe("mep_http_request_duration_seconds", labels, secs);
  if (c->route && c->route->pattern == "/v1/leases" && c->route->method == bhttp::verb::post)
    m.inc("mep_claims_total", "outcome=\"" + (r.outcome.empty() ? std::to_string(r.status) : r.outcome) + "\"");
  if (c->route && (c->route->pattern == "/v1/leases/renew" || c->route->pattern == "/v1/leases/renew-batch"))
    m.observe("mep_lease_renewal_latency_seconds", "", secs);
  if (r.status >= 500) log::warn("request {} {} -> {}", c->ctx.request_id, c->route_label, r.status);
  else log::debug("request {} {} -> {} in {:.2f} ms", c->ctx.request_id, c->route_label, r.status, secs * 1000);
  auto res = make_response(*c, r);
  for (const auto& [k, v] : extra) res.set(k, v);
  c->send(std::move(res));
}

void fail(const CallPtr& c, Problem p) { finish(c, problem_reply(std::move(p), c->ctx.request_id)); }

// The store's completion: it may arrive on the store's thread; `send` posts to the session.
Done reply_to(CallPtr c) {
  return [c = std::move(c)](Reply r) { finish(c, std::move(r)); };
}

std::optional<std::string> header_once(const HttpRequest& req, bhttp::field f, bool& doubled) {
  auto range = req.equal_range(f);
  std::optional<std::string> value;
  doubled = false;
  for (auto it = range.first; it != range.second; ++it) {
    if (value) doubled = true;
    value = std::string(it->value());
  }
  return value;
}

std::optional<std::string> header_once(const HttpRequest& req, std::string_view name, bool& doubled) {
  auto range = req.equal_range(name);
  std::optional<std::string> value;
  doubled = false;
  for (auto it = range.first; it != range.second; ++it) {
    if (value) doubled = true;
    value = std::string(it->value());
  }
  return value;
}

// Authenticates the bearer token (SPEC §6: before anything else).
bool authenticate(const CallPtr& c, Store& store, RateLimiter& audit_budget) {
  bool doubled = false;
  auto h = header_once(c->req, bhttp::field::authorization, doubled);
  auto unauth = [&](std::string detail) {
    Metrics::global().inc("mep_auth_failures_total");
    fail(c, Problem(Code::unauthenticated, std::move(detail)));
    return false;
  };
  if (!h) return unauth("an Authorization: Bearer token is required");
  if (doubled) return unauth("more than one Authorization header");
  std::string_view v = *h;
  if (v.size() < 7 || !(v.substr(0, 7) == "Bearer " || v.substr(0, 7) == "bearer "))
    return unauth("the Authorization header must be 'Bearer <token>'");
  v.remove_prefix(7);
  while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
  while (!v.empty() && v.back() == ' ') v.remove_suffix(1);
  if (v.empty() || v.size() > 512) return unauth("invalid bearer token");
  std::optional<AuthInfo> auth;
  try {
    auth = store.authenticate(sha256_hex(v));
  } catch (const std::exception& e) {
    log::error("authentication lookup failed: {}", e.what());
    fail(c, db_unavailable());
    return false;
  }
  if (!auth) {
    if (audit_budget.acquire("auth-failed") == 0) store.audit_auth_failure("");
    return unauth("unknown or revoked bearer token");
  }
  c->ctx.auth = *auth;
  return true;
}

// Decodes the JSON body of a POST: media type, size (the parser enforces 16 KiB), syntax.
std::optional<boost::json::object> body_object(const CallPtr& c, bool empty_ok) {
  if (empty_ok && c->req.body().empty()) return boost::json::object{};
  bool doubled = false;
  auto ct = header_once(c->req, bhttp::field::content_type, doubled);
  if (doubled) {
    fail(c, Problem(Code::invalid_request, "more than one Content-Type header"));
    return std::nullopt;
  }
  std::string_view type = ct ? std::string_view(*ct) : std::string_view();
  type = type.substr(0, type.find(';'));
  while (!type.empty() && type.back() == ' ') type.remove_suffix(1);
  bool is_json = type.size() == 16 && std::equal(type.begin(), type.end(), "application/json",
                                                 [](char a, char b) { return std::tolower(a) == b; });
  if (!is_json) {
    fail(c, Problem(Code::unsupported_media_type, "the request body must be application/json"));
    return std::nullopt;
  }
  auto obj = json::parse_object(c->req.body());
  if (!obj) {
    fail(c, std::move(obj.error()));
    return std::nullopt;
  }
  return std::move(*obj);
}

std::optional<Idempotency> idempotency(const CallPtr& c, const boost::json::object& body) {
  bool doubled = false;
  auto h = header_once(c->req, "Idempotency-Key", doubled);
  if (!h) {
    fail(c, Problem(Code::idempotency_key_missing, "this request needs an Idempotency-Key header"));
    return std::nullopt;
  }
  auto key = doubled ? std::nullopt : parse_idempotency_key(*h);
  if (!key) {
    fail(c, Problem(Code::idempotency_key_invalid,
                    "Idempotency-Key must be 1-255 printable ASCII characters, once"));
    return std::nullopt;
  }
  std::string material = std::string(c->req.method_string()) + " " + std::string(c->route->pattern) +
                         " " + (c->params.empty() ? "" : c->params.front()) + "\n" + json::canonical(body);
  return Idempotency{*key, sha256_hex(material)};
}

bool finish_reader(const CallPtr& c, json::ObjectReader& r) {
  if (auto ok = r.finish(); !ok) {
    fail(c, std::move(ok.error()));
    return false;
  }
  return true;
}

std::optional<std::string> owner_field(json::ObjectReader& r) {
  auto owner = r.string("owner_client_id", Need::required);
  if (owner && (owner->empty() || owner->size() > 255)) {
    r.fail("field \"owner_client_id\" must be 1-255 bytes");
    return std::nullopt;
  }
  return owner;
}

// ---- handlers -----------------------------------------------------------------------------

void on_register(const CallPtr& c, Store& store) {
  auto body = body_object(c, true);
  if (!body) return;
  json::ObjectReader r(*body);
  RegisterMemory req;
  auto id = r.string("memory_instance_id", Need::optional);
  if (id) {
    if (!is_uuid_v7(*id)) r.fail("field \"memory_instance_id\" must be a UUIDv7");
    else req.memory_id = Uuid::parse(*id)->to_string();
  }
  if (!finish_reader(c, r)) return;
  auto idem = idempotency(c, *body);
  if (!idem) return;
  store.register_memory(c->ctx, std::move(*idem), std::move(req), reply_to(c));
}

// A 423 says how many claims wait for the resource (`waiters`): the position is not a
// secret, the holder's identity is.
Reply with_waiters(Reply r, std::size_t waiters) {
  if (r.status != 423 || !r.problem || waiters == 0) return r;
  auto o = json::parse_object(r.body);
  if (!o) return r;
  (*o)["waiters"] = static_cast<std::int64_t>(waiters);
  r.body = json::dump(*o);
  return r;
}

// The resources a claim contends for in the wait queue.
std::vector<std::string> claim_keys(const CanonicalName& name, const std::string& memory_id) {
  return {name_key(name.skeleton), memory_key(memory_id)};
}

// 429 for a wait queue at its bound, with the bound in `limit`.
Problem too_many_waiters(std::string detail, std::size_t limit) {
  Problem p(Code::rate_limited, std::move(detail));
  p.extensions["limit"] = static_cast<std::int64_t>(limit);
  p.retry_after_s = 1;
  return p;
}

void on_claim(const CallPtr& c, Store& store, WaitQueue& waits) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  auto display = r.string("display_name", Need::required);
  auto memory = r.uuid("memory_instance_id", Need::required);
  auto owner = owner_field(r);
  auto ttl = r.integer("ttl_seconds", Need::optional, -k_any_ttl, k_any_ttl);
  if (!finish_reader(c, r)) return;
  auto idem = idempotency(c, *body);
  if (!idem) return;
  Claim req{*display, canonicalize(*display), *memory, *owner, ttl.value_or(k_default_ttl_s)};
  std::optional<std::int64_t> wait_s; // the first wait preference of all Prefer fields
  for (auto [it, end] = c->req.equal_range("Prefer"); it != end && !wait_s; ++it)
    wait_s = parse_prefer_wait(it->value());
  if (!req.name || !wait_s || *wait_s <= 0) {
    // No wait: the store answers; a refusal says how many wait for the resource. The same
    // request waiting here already holds its key in flight.
    if (waits.in_flight(c->ctx.auth.tenant_id, idem->key)) {
      Problem p(Code::idempotency_request_in_flight, "a claim under this Idempotency-Key is waiting");
      p.retry_after_s = 1;
      return fail(c, std::move(p));
    }
    std::vector<std::string> keys;
    if (req.name) keys = claim_keys(*req.name, req.memory_id);
    return store.claim(c->ctx, std::move(*idem), std::move(req),
                       [c, &waits, keys = std::move(keys)](Reply reply) {
                         if (reply.status == 423 && !keys.empty()) reply = with_waiters(std::move(reply), waits.waiting(keys));
                         finish(c, std::move(reply));
                       });
  }
  // Prefer: wait=N (RFC 7240), at most k_max_wait_s.
  const std::int64_t applied = std::min(*wait_s, k_max_wait_s);
  const auto start = WaitQueue::Clock::now();
  WaitQueue::Waiter w;
  w.tenant = c->ctx.auth.tenant_id;
  w.keys = claim_keys(*req.name, req.memory_id);
  w.idem_key = idem->key;
  w.fingerprint = idem->fingerprint;
  w.deadline = start + std::chrono::seconds(applied);
  w.fd = c->fd;
  req.record_refusal = false;
  w.attempt = [&store, ctx = c->ctx, idem = *idem, req](WaitQueue::Callback cb) {
    store.claim(ctx, idem, req, std::move(cb));
  };
  w.answer = [c, applied, start](Reply reply, std::string_view, std::size_t ahead, WaitQueue::Clock::time_point decided) {
    // Up to the start of the attempt that decided: a grant is no earlier than the request's
    // arrival plus this, so a client may count its lease from its sending plus this.
    auto ms = std::max<std::int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(std::max(decided, start) - start).count());
    ExtraHeaders extra{{"Preference-Applied", "wait=" + std::to_string(applied)},
                       {"Mep-Waited-Ms", std::to_string(ms)}};
    finish(c, with_waiters(std::move(reply), ahead), extra);
  };
  switch (waits.wait(std::move(w))) {
  case WaitQueue::Joined::queued:
  case WaitQueue::Joined::rejoined:
    return;
  case WaitQueue::Joined::mismatch:
    return fail(c, Problem(Code::idempotency_key_reused, "this Idempotency-Key is waiting with a different request"));
  case WaitQueue::Joined::resource_full:
    return fail(c, too_many_waiters(fmt::format("at most {} claims may wait for one name or memory",
                                                k_max_waiters_per_resource),
                                    k_max_waiters_per_resource));
  case WaitQueue::Joined::tenant_full:
    return fail(c, too_many_waiters(fmt::format("at most {} claims of one tenant may wait at once",
                                                k_max_waiters_per_tenant),
                                    k_max_waiters_per_tenant));
  case WaitQueue::Joined::stopped: {
    Problem p(Code::unavailable, "the server is shutting down; claim again");
    p.retry_after_s = 1;
    return fail(c, std::move(p));
  }
  }
}

std::optional<LeaseRef> lease_ref(json::ObjectReader& r, bool with_owner, bool with_ttl) {
  LeaseRef ref;
  auto name = r.string("canonical_name", Need::required);
  auto memory = r.uuid("memory_instance_id", Need::required);
  auto token = r.integer("fencing_token", Need::required, 0, k_max_token);
  std::optional<std::string> owner;
  if (with_owner) owner = owner_field(r);
  std::optional<std::int64_t> ttl;
  if (with_ttl) ttl = r.integer("ttl_seconds", Need::optional, -k_any_ttl, k_any_ttl);
  if (!name || !memory || !token || (with_owner && !owner)) return std::nullopt;
  ref.canonical_name = *name;
  ref.memory_id = *memory;
  ref.fencing_token = *token;
  if (owner) ref.owner_client_id = *owner;
  ref.ttl_s = ttl.value_or(k_default_ttl_s);
  return ref;
}

void on_renew(const CallPtr& c, Store& store) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  auto ref = lease_ref(r, true, true);
  if (!finish_reader(c, r)) return;
  store.renew(c->ctx, std::move(*ref), reply_to(c));
}

void on_renew_batch(const CallPtr& c, Store& store) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  RenewBatch req;
  auto owner = owner_field(r);
  const auto* items = r.array("leases", Need::required);
  if (items && items->size() > k_max_batch)
    r.fail("field \"leases\" holds at most " + std::to_string(k_max_batch) + " leases");
  else if (items) {
    for (std::size_t i = 0; i < items->size(); ++i) {
      const auto& v = (*items)[i];
      if (!v.is_object()) {
        r.fail("leases[" + std::to_string(i) + "] must be an object");
        continue;
      }
      json::ObjectReader ir(v.get_object());
      auto ref = lease_ref(ir, false, true);
      // A daemon renews the leases of several local owners in one call: an item may
      // name its own owner; otherwise the batch's owner applies.
      auto item_owner = ir.string("owner_client_id", Need::optional);
      if (ref && item_owner) ref->owner_client_id = *item_owner;
      if (auto ok = ir.finish(); !ok) r.fail("leases[" + std::to_string(i) + "]: " + ok.error().detail);
      else if (ref) req.leases.push_back(std::move(*ref));
    }
  }
  if (!finish_reader(c, r)) return;
  req.owner_client_id = *owner;
  store.renew_batch(c->ctx, std::move(req), reply_to(c));
}

// After a release or a revocation: the oldest waiters for what it freed are tried.
std::vector<std::string> freed_keys(const std::string& canonical_name, const std::string& memory_id) {
  std::vector<std::string> keys;
  if (auto n = canonicalize(canonical_name)) keys.push_back(name_key(n->skeleton));
  if (!memory_id.empty()) keys.push_back(memory_key(memory_id));
  return keys;
}

void on_release(const CallPtr& c, Store& store, WaitQueue& waits) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  auto ref = lease_ref(r, true, false);
  if (!finish_reader(c, r)) return;
  auto keys = freed_keys(ref->canonical_name, ref->memory_id);
  store.release(c->ctx, std::move(*ref), [c, &waits, keys = std::move(keys)](Reply reply) {
    const bool ok = reply.status < 300;
    finish(c, std::move(reply));
    if (ok) waits.freed(keys);
  });
}

void on_branch(const CallPtr& c, Store& store) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  Branch req;
  auto parent = r.uuid("parent_memory_instance_id", Need::required);
  auto token = r.integer("parent_fencing_token", Need::required, 0, k_max_token);
  auto id = r.string("memory_instance_id", Need::optional);
  if (id) {
    if (!is_uuid_v7(*id)) r.fail("field \"memory_instance_id\" must be a UUIDv7");
    else req.memory_id = Uuid::parse(*id)->to_string();
  }
  if (!finish_reader(c, r)) return;
  auto idem = idempotency(c, *body);
  if (!idem) return;
  req.parent_memory_id = *parent;
  req.parent_fencing_token = *token;
  store.branch(c->ctx, std::move(*idem), std::move(req), reply_to(c));
}

void on_verify(const CallPtr& c, Store& store) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  auto memory = r.uuid("memory_instance_id", Need::required);
  auto token = r.integer("fencing_token", Need::required, 0, k_max_token);
  if (!finish_reader(c, r)) return;
  store.verify(c->ctx, Verify{*memory, *token}, reply_to(c));
}

// A name from a URL or a body: its canonical form when it is a valid name, else as given
// (then it simply matches no lease).
std::string lookup_name(const std::string& raw) {
  auto n = canonicalize(raw);
  return n ? n->canonical_name : raw;
}

void on_revoke(const CallPtr& c, Store& store, WaitQueue& waits) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  auto name = r.string("canonical_name", Need::required);
  if (!finish_reader(c, r)) return;
  std::string canonical = lookup_name(*name);
  auto keys = freed_keys(canonical, "");
  store.revoke(c->ctx, std::move(canonical), [c, &waits, keys = std::move(keys)](Reply reply) {
    const bool ok = reply.status < 300;
    std::vector<std::string> all = keys;
    if (ok) {
      if (auto o = json::parse_object(reply.body))
        if (const auto* m = o->if_contains("memory_instance_id"); m && m->is_string())
          all.push_back(memory_key(std::string(m->as_string())));
    }
    finish(c, std::move(reply));
    if (ok) waits.freed(all);
  });
}

void on_get_lease(const CallPtr& c, Store& store) {
  // Bytes that are not UTF-8 (or hold NUL) name no lease; no store needs to look.
  const std::string& raw = c->params[0];
  if (!utf8::decode(raw) || raw.find('\0') != std::string::npos)
    return fail(c, Problem(Code::lease_not_found, "no live lease of this tenant under this name"));
  store.get_lease(c->ctx, lookup_name(raw), reply_to(c));
}

// A `limit` query value: digits only (no sign, no spaces), from 1 to `max`.
std::optional<std::size_t> page_limit(std::string_view v, std::size_t max) {
  if (v.empty() || v.size() > 6 || v.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  std::size_t n = 0;
  for (char ch : v) n = n * 10 + static_cast<std::size_t>(ch - '0');
  if (n < 1 || n > max) return std::nullopt;
  return n;
}

void on_list_leases(const CallPtr& c, Store& store) {
  ListLeases req;
  std::vector<std::string> seen;
  for (auto p : c->query) {
    if (std::find(seen.begin(), seen.end(), p.key) != seen.end())
      return fail(c, Problem(Code::invalid_request, "query parameter \"" + std::string(p.key) + "\" given twice"));
    seen.emplace_back(p.key);
    if (p.key == "owner_client_id") {
      req.owner_client_id = std::string(p.value);
    } else if (p.key == "cursor") {
      // A cursor is the last canonical name of the page before (next_cursor): anything
      // else was not given out by this server.
      auto n = canonicalize(p.value);
      if (!n || n->canonical_name != p.value)
        return fail(c, Problem(Code::invalid_request, "cursor is not a next_cursor this server returned"));
      req.cursor = std::string(p.value);
    } else if (p.key == "limit") {
      auto n = page_limit(p.value, 1000);
      if (!n) return fail(c, Problem(Code::invalid_request, "limit must be an integer from 1 to 1000"));
      req.limit = *n;
    } else {
      return fail(c, Problem(Code::invalid_request, "unknown query parameter \"" + std::string(p.key) + "\""));
    }
  }
  store.list_leases(c->ctx, std::move(req), reply_to(c));
}

bool uuid_param(const CallPtr& c, std::string& out) {
  auto u = Uuid::parse(c->params[0]);
  if (!u) {
    fail(c, Problem(Code::invalid_request, "the memory id in the path must be a UUID"));
    return false;
  }
  out = u->to_string();
  return true;
}

void on_get_memory(const CallPtr& c, Store& store) {
  std::string id;
  if (uuid_param(c, id)) store.get_memory(c->ctx, id, reply_to(c));
}

void on_lineage(const CallPtr& c, Store& store) {
  std::string id;
  if (uuid_param(c, id)) store.lineage(c->ctx, id, reply_to(c));
}

void on_identity_map(const CallPtr& c, Store& store) {
  std::optional<std::string> cursor;
  std::size_t limit = 1000;
  for (auto q : c->query) {
    if (q.key == "cursor") {
      cursor = std::string(q.value);
    } else if (q.key == "limit") {
      auto n = page_limit(q.value, 10000);
      if (!n) return fail(c, Problem(Code::invalid_request, "limit must be an integer from 1 to 10000"));
      limit = *n;
    } else {
      return fail(c, Problem(Code::invalid_request, "unknown query parameter \"" + std::string(q.key) + "\""));
    }
  }
  store.identity_map(c->ctx, std::move(cursor), limit, reply_to(c));
}

void on_metrics(const CallPtr& c, Store& store) {
  auto& m = Metrics::global();
  try {
    m.set("mep_leases_active", static_cast<double>(store.active_leases()));
    m.set("mep_db_transaction_retries_total", static_cast<double>(store.transaction_retries()));
  } catch (const std::exception& e) {
    log::warn("metrics: {}", e.what());
  }
  Reply r;
  r.status = 200;
  r.body = m.render();
  HttpResponse res = make_response(*c, r);
  res.set(bhttp::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
  c->send(std::move(res));
}

void on_health(const CallPtr& c, Store& store, bool readiness) {
  bool ok = !readiness || store.ready();
  if (ok) return finish(c, json_reply(200, boost::json::object{{"status", "ok"}}));
  Problem p(Code::unavailable, "the database cannot be read or written (unreachable, full or failing)");
  p.retry_after_s = 1;
  fail(c, std::move(p));
}

} // namespace

std::optional<std::string> parse_idempotency_key(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  std::string out;
  if (!v.empty() && v.front() == '"') {
    if (v.size() < 2 || v.back() != '"') return std::nullopt;
    v = v.substr(1, v.size() - 2);
    for (std::size_t i = 0; i < v.size(); ++i) {
      char ch = v[i];
      if (ch == '\\') {
        if (i + 1 >= v.size() || (v[i + 1] != '"' && v[i + 1] != '\\')) return std::nullopt;
        out.push_back(v[++i]);
      } else if (ch == '"' || ch < 0x20 || ch > 0x7E) {
        return std::nullopt;
      } else {
        out.push_back(ch);
      }
    }
  } else {
    for (char ch : v)
      if (ch < 0x21 || ch > 0x7E) return std::nullopt;
    out.assign(v);
  }
  if (out.empty() || out.size() > 255) return std::nullopt;
  return out;
}

Router::Router(Store& store, double rate_limit) : m_store(store), m_limiter(rate_limit), m_auth_failures(5) {
  // Releases through other servers on the same database wake the claims waiting here.
  m_store.set_freed_listener([this](const std::string& name, const std::string& memory) {
    m_waits.freed(freed_keys(name, memory));
  });
}

// The store may already be gone (the server closes it first, to finish its queued jobs,
// whose completions use this router): it stops calling the listener when it closes.
Router::~Router() = default;

http::BodyPlan Router::plan(const http::RequestHeader& header, const Peer&) {
  http::BodyPlan plan;
  plan.limit = body_limit_for(header.target());
  return plan;
}

void Router::handle(http::Request&& req, const Peer& peer, std::shared_ptr<http::BodySink>, http::Responder responder) {
  const int fd = responder.native_handle();
  dispatch(std::move(req), peer, [responder](HttpResponse&& res) { responder.send(std::move(res)); }, fd);
}

void Router::handle(HttpRequest&& req, const Peer& peer, Send send) { dispatch(std::move(req), peer, std::move(send), -1); }

void Router::dispatch(HttpRequest&& req, const Peer& peer, Send send, int fd) {
  auto c = std::make_shared<Call>();
  c->req = std::move(req);
  c->peer = peer;
  c->send = std::move(send);
  c->fd = fd;
  c->ctx.request_id = uuid_v7().to_string();
  // HEAD is GET without the content (RFC 9110 §9.3.2): the same checks, status and headers,
  // Content-Length included, so that `curl -I` and load-balancer probes work; the edge
  // sends only the head.
  const bool head = c->req.method() == bhttp::verb::head;
  const bhttp::verb method = head ? bhttp::verb::get : c->req.method();

  // 1. Route: 404 for unknown paths, 405 (with Allow) for known paths and other methods.
  auto target = boost::urls::parse_origin_form(c->req.target());
  if (!target) return fail(c, Problem(Code::invalid_request, "malformed request target"));
  std::vector<std::string> segs;
  for (auto s : target->segments()) segs.emplace_back(s);
  if (segs.empty()) segs.emplace_back();
  c->query = target->params();
  std::string allow;
  for (const auto& r : k_routes) {
    std::vector<std::string> params;
    if (!match(r.pattern, segs, params)) continue;
    if (r.method == method) {
      c->route = &r;
      c->params = std::move(params);
      break;
    }
    if (!allow.empty()) allow += ", ";
    allow += http::allow_entry(r.method);
  }
  if (!c->route) {
    if (allow.empty()) return fail(c, Problem(Code::not_found, "no such endpoint"));
    Reply r = problem_reply(Problem(Code::method_not_allowed, "this endpoint does not accept that method"),
                            c->ctx.request_id);
    r.allow = std::move(allow);
    return finish(c, std::move(r));
  }
  c->route_label = std::string(c->route->pattern);
  const RouteSpec& route = *c->route;

  // 16 KiB bodies, except renew-batch (up to 1000 leases in one call).
  if (c->req.body().size() > body_limit_for(route.pattern))
    return fail(c, Problem(Code::payload_too_large, "the body exceeds 16 KiB"));

  // 2. Authentication and scope (metrics are open on loopback only).
  if (route.auth == Auth::none) return on_health(c, m_store, route.pattern == "/readyz");
  if (route.auth == Auth::metrics && peer.loopback) return on_metrics(c, m_store);
  if (!authenticate(c, m_store, m_auth_failures)) return;
  bool need_admin = route.auth == Auth::admin || route.auth == Auth::metrics;
  if ((need_admin && !c->ctx.auth.scope_admin) || (!need_admin && !c->ctx.auth.scope_lease))
    return fail(c, Problem(Code::forbidden, need_admin ? "this endpoint needs the admin scope"
                                                       : "this token lacks the lease scope"));

  // 3. Rate limit per token. Renewals and releases go first: every other request leaves a
  // fifth of the bucket to them, so a storm of claims (or of waiting claims' retries) from
  // one daemon does not cost it the leases it holds.
  const bool keeps_leases = route.pattern == "/v1/leases/renew" || route.pattern == "/v1/leases/renew-batch" ||
                            route.pattern == "/v1/leases/release";
  const double reserve = keeps_leases ? 0.0 : std::max(1.0, m_limiter.rate() / 5);
  if (int wait = m_limiter.acquire(c->ctx.auth.token_id, reserve); wait > 0) {
    Metrics::global().inc("mep_rate_limited_total");
    Problem p(Code::rate_limited, "too many requests for this token");
    p.retry_after_s = wait;
    return fail(c, std::move(p));
  }

  // 4. The migration gate, then the handler.
  const auto& p = route.pattern;
  if (route.method == bhttp::verb::post && gated_by_migration(p) && m_store.migration_in_progress()) {
    Problem gate(Code::migration_in_progress, "a legacy migration is in progress; leases resume after 'mep migrate activate'");
    gate.retry_after_s = 5;
    return fail(c, std::move(gate));
  }
  if (p == "/v1/migration/identity-map") return on_identity_map(c, m_store);
  if (p == "/metrics") return on_metrics(c, m_store);
  if (p == "/v1/memories") return on_register(c, m_store);
  if (p == "/v1/memories/branch") return on_branch(c, m_store);
  if (p == "/v1/memories/{id}") return on_get_memory(c, m_store);
  if (p == "/v1/memories/{id}/lineage") return on_lineage(c, m_store);
  if (p == "/v1/leases") return route.method == bhttp::verb::post ? on_claim(c, m_store, m_waits) : on_list_leases(c, m_store);
  if (p == "/v1/leases/renew") return on_renew(c, m_store);
  if (p == "/v1/leases/renew-batch") return on_renew_batch(c, m_store);
  if (p == "/v1/leases/release") return on_release(c, m_store, m_waits);
  if (p == "/v1/leases/{canonical_name}") return on_get_lease(c, m_store);
  if (p == "/v1/fence/verify") return on_verify(c, m_store);
  if (p == "/v1/admin/leases/revoke") return on_revoke(c, m_store, m_waits);
  fail(c, Problem(Code::not_found, "no such endpoint"));
}

} // namespace mep::server
