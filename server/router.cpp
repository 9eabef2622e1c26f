// The control plane's HTTP edge: one route table whose rows say everything about a route
// (method, pattern, auth scope, Idempotency-Key, migration gate, rate-limit priority, body
// limit, metric, handler), and handlers that decode the request, call the LeaseService and
// encode its typed outcome (lease/wire.hpp) with the HTTP status and headers of SPEC §6.
#include "router_internal.hpp"

namespace mep::server {
using namespace router_detail;

namespace {

// ---- handlers: decode, call the service, encode ------------------------------------------

void on_register(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, true);
  if (!body) return;
  auto req = wire::read_register_request(*body);
  if (!req) return fail(c, std::move(req.error()));
  auto idem = idempotency(c, *body);
  if (!idem) return;
  svc.register_memory(c->ctx, std::move(*idem), std::move(*req), answer_created<lease::Registered>(c));
}

void on_claim(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  auto decoded = wire::read_claim_request(*body, k_any_ttl);
  if (!decoded) return fail(c, std::move(decoded.error()));
  auto idem = idempotency(c, *body);
  if (!idem) return;
  const lease::ClaimRequest& req = *decoded;
  WaitSpec wait;
  wait.watch_fd = c->fd;
  std::optional<std::int64_t> wait_s; // the first wait preference of all Prefer fields (RFC 7240)
  for (auto [it, end] = c->req.equal_range("Prefer"); it != end && !wait_s; ++it)
    wait_s = parse_prefer_wait(it->value());
  wait.seconds = wait_s.value_or(0);
  svc.claim(c->ctx, std::move(*idem), req, wait, [c](ClaimAnswer a) {
    const ClaimOutcome& o = a.outcome;
    // 201 for a grant, 200 for its replay.
    Reply reply = encode(c, o, o.replayed ? 200 : 201);
    if (a.applied_wait_s) {
      reply.headers.emplace_back("Preference-Applied", "wait=" + std::to_string(*a.applied_wait_s));
      reply.headers.emplace_back("Mep-Waited-Ms", std::to_string(a.waited_ms));
    }
    std::string_view label = o.replayed ? "replayed"
                             : o.ok()   ? (o.value->reclaimed ? "reclaimed" : "granted")
                                        : o.value.error().slug();
    finish(c, std::move(reply), label);
  });
}

// POST /v1/leases/claim-batch: {claims: [{idempotency_key, ...a claim's fields}]}, each
// claim decided as if it had come alone to POST /v1/leases under its key (the same
// fingerprint, so a retry either way replays it), none waiting. 200 with {results: [...]}
// in the request's order, each {status, lease} or {status, problem}: a daemon that many
// agents attach through at once (a swarm's start) sends their claims in one request.
void on_claim_batch(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  json::ObjectReader r(*body);
  struct Item {
    lease::ClaimRequest req;
    Idempotency idem;
  };
  std::vector<Item> claims;
  const auto* items = r.array("claims", Need::required);
  if (items && (items->empty() || items->size() > lease::k_max_claim_batch)) {
    r.fail("field \"claims\" holds 1 to " + std::to_string(lease::k_max_claim_batch) + " claims");
  } else if (items) {
    for (std::size_t i = 0; i < items->size(); ++i) {
      const std::string at = "claims[" + std::to_string(i) + "]";
      const auto& v = (*items)[i];
      if (!v.is_object()) {
        r.fail(at + " must be an object");
        continue;
      }
      boost::json::object claim = v.get_object();
      std::optional<std::string> key;
      if (auto* k = claim.if_contains("idempotency_key"); k && k->is_string())
        key = parse_idempotency_key(k->get_string());
      if (!key) {
        r.fail(at + ": field \"idempotency_key\" must be 1-255 printable ASCII characters");
        continue;
      }
      claim.erase("idempotency_key");
      auto decoded = wire::read_claim_request(claim, k_any_ttl);
      if (!decoded) {
        r.fail(at + ": " + decoded.error().detail);
        continue;
      }
      claims.push_back(
          Item{std::move(*decoded), Idempotency{*key, request_fingerprint("POST", "/v1/leases", "", claim)}});
    }
  }
  if (!finish_reader(c, r)) return;
  struct Gather {
    std::mutex mutex;
    boost::json::array results;
    std::size_t left;
  };
  auto g = std::make_shared<Gather>();
  g->results.resize(claims.size());
  g->left = claims.size();
  for (std::size_t i = 0; i < claims.size(); ++i) {
    svc.claim(c->ctx, std::move(claims[i].idem), claims[i].req, WaitSpec{}, [c, g, i](ClaimAnswer a) {
      const ClaimOutcome& o = a.outcome;
      boost::json::object item;
      if (o.ok()) {
        item["status"] = o.replayed ? 200 : 201;
        item["lease"] = wire::to_json(*o.value);
      } else {
        Problem p = o.value.error();
        if (p.instance.empty()) p.instance = c->ctx.request_id;
        item["status"] = p.status();
        item["problem"] = p.to_json();
      }
      Metrics::global().inc("mep_claims_total",
                            "outcome=\"" +
                                std::string(o.replayed ? "replayed"
                                            : o.ok()   ? (o.value->reclaimed ? "reclaimed" : "granted")
                                                       : o.value.error().slug()) +
                                "\"");
      std::lock_guard lock(g->mutex);
      g->results[i] = std::move(item);
      if (--g->left > 0) return;
      Reply reply;
      reply.status = 200;
      reply.body = json::dump(boost::json::object{{"results", std::move(g->results)}});
      finish(c, std::move(reply));
    });
  }
}

// mep_renewals_total's label for one renewal's outcome: renewed, or the problem's code, with
// the leases an operator or the hold limit ended told apart.
std::string renewal_outcome(int status, std::string_view code, std::string_view reason) {
  if (status == 200) return "renewed";
  std::string label(reason == "max-hold" || reason == "revoked" ? reason : code);
  if (label.empty()) label = "other";
  std::replace(label.begin(), label.end(), '-', '_');
  return label;
}

void count_renewal(int status, std::string_view code, std::string_view reason) {
  Metrics::global().inc("mep_renewals_total", "outcome=\"" + renewal_outcome(status, code, reason) + "\"");
}

void on_renew(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  auto ref = wire::read_lease_ref(*body, wire::RefForm::renew, k_any_ttl);
  if (!ref) return fail(c, std::move(ref.error()));
  svc.renew(c->ctx, std::move(*ref), [c](Outcome<lease::Renewed> o) {
    if (o.ok()) {
      count_renewal(200, {}, {});
    } else {
      const auto* reason = o.value.error().extensions.if_contains("reason");
      count_renewal(o.value.error().status(), o.value.error().slug(),
                    reason && reason->is_string() ? std::string_view(reason->get_string()) : std::string_view());
    }
    finish(c, encode(c, o, 200));
  });
}

void on_renew_batch(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  auto req = wire::read_renew_batch_request(*body, k_any_ttl);
  if (!req) return fail(c, std::move(req.error()));
  svc.renew_batch(c->ctx, std::move(*req), [c](Outcome<lease::RenewBatchResult> o) {
    if (o.ok())
      for (const auto& item : o.value->results) count_renewal(item.status, item.code, item.reason);
    finish(c, encode(c, o, 200));
  });
}

void on_release(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  auto ref = wire::read_lease_ref(*body, wire::RefForm::release, k_any_ttl);
  if (!ref) return fail(c, std::move(ref.error()));
  svc.release(c->ctx, std::move(*ref), answer<Released, 204>(c));
}

void on_branch(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  auto req = wire::read_branch_request(*body);
  if (!req) return fail(c, std::move(req.error()));
  auto idem = idempotency(c, *body);
  if (!idem) return;
  svc.branch(c->ctx, std::move(*idem), std::move(*req), answer_created<lease::Branched>(c));
}

void on_verify(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  auto req = wire::read_verify_request(*body);
  if (!req) return fail(c, std::move(req.error()));
  svc.verify(c->ctx, std::move(*req), answer<lease::Verified, 200>(c));
}

void on_revoke(const CallPtr& c, LeaseService& svc) {
  auto body = body_object(c, false);
  if (!body) return;
  auto req = wire::read_revoke_request(*body);
  if (!req) return fail(c, std::move(req.error()));
  svc.revoke(c->ctx, req->canonical_name, std::move(req->reason), answer<Revoked, 204>(c));
}

// ---- the route table (SPEC §6) --------------------------------------------------------------

constexpr std::size_t k_small = k_body_limit;
constexpr std::size_t k_batch = k_batch_body_limit;
constexpr bhttp::verb GET = bhttp::verb::get;
constexpr bhttp::verb POST = bhttp::verb::post;

// The first row whose pattern and method match wins (order matters only for equal paths).
// clang-format off
constexpr Route k_routes[] = {
    // method, pattern,                        auth,          idempotency,    gate,            priority,               body,    metric,          handler
    {GET,  "/healthz",                         Auth::none,    Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_health<on_healthz>},
    {GET,  "/readyz",                          Auth::none,    Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_health<on_readyz>},
    {GET,  "/metrics",                         Auth::metrics, Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_health<on_metrics>},
    {POST, "/v1/memories",                     Auth::lease,   Idem::required, Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_register>},
    {POST, "/v1/memories/branch",              Auth::lease,   Idem::required, Gate::migration, Priority::normal,       k_small, Metric::none,    by_service<on_branch>},
    {GET,  "/v1/memories/{id}",                Auth::lease,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_get_memory>},
    {GET,  "/v1/memories/{id}/lineage",        Auth::lease,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_lineage>},
    {POST, "/v1/leases",                       Auth::lease,   Idem::required, Gate::migration, Priority::normal,       k_small, Metric::claims,  by_service<on_claim>},
    {GET,  "/v1/leases",                       Auth::lease,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_list_leases>},
    {POST, "/v1/leases/claim-batch",           Auth::lease,   Idem::none,     Gate::migration, Priority::normal,       k_batch, Metric::none,    by_service<on_claim_batch>},
    {POST, "/v1/leases/renew",                 Auth::lease,   Idem::none,     Gate::migration, Priority::keeps_leases, k_small, Metric::renewals, by_service<on_renew>},
    {POST, "/v1/leases/renew-batch",           Auth::lease,   Idem::none,     Gate::migration, Priority::keeps_leases, k_batch, Metric::renewals, by_service<on_renew_batch>},
    {POST, "/v1/leases/release",               Auth::lease,   Idem::none,     Gate::migration, Priority::keeps_leases, k_small, Metric::none,    by_service<on_release>},
    {GET,  "/v1/leases/{canonical_name}",      Auth::lease,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_get_lease>},
    {POST, "/v1/fence/verify",                 Auth::lease,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_verify>},
    {POST, "/v1/admin/leases/revoke",          Auth::admin,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_revoke>},
    {GET,  "/v1/admin/leases/{canonical_name}/history", Auth::admin, Idem::none, Gate::open,    Priority::normal,       k_small, Metric::none,    by_service<on_history>},
    {GET,  "/v1/admin/check",                  Auth::admin,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_admin_check>},
    {GET,  "/v1/migration/identity-map",       Auth::lease,   Idem::none,     Gate::open,      Priority::normal,       k_small, Metric::none,    by_service<on_identity_map>},
};
// clang-format on

// The path's segments ("" for "/").
std::vector<std::string> segments_of(const boost::urls::url_view_base& u) {
  std::vector<std::string> segs;
  for (auto s : u.segments()) segs.emplace_back(s);
  if (segs.empty()) segs.emplace_back();
  return segs;
}

// Where a request goes: its route, or the methods its path allows (for 405).
struct Found {
  bool parsed = false;          // the target is an origin-form URI
  const Route* route = nullptr; // null: 404 (allow empty) or 405
  std::string allow;
  bool open_path = false; // the path is only that of open endpoints (/healthz): its 405 needs no token
};

Found find_route(std::string_view raw_target, bhttp::verb method, std::vector<std::string>* params = nullptr,
                 boost::urls::params_view* query = nullptr) {
  Found found;
  if (method == bhttp::verb::head) method = bhttp::verb::get;
  auto target = boost::urls::parse_origin_form(raw_target);
  if (!target) return found;
  found.parsed = true;
  std::vector<std::string> segs = segments_of(*target);
  if (query) *query = target->params();
  bool all_open = true; // of the routes on this path with other methods
  for (const auto& r : k_routes) {
    if (!match(r.pattern, segs)) continue;
    if (r.method == method) {
      found.route = &r;
      if (params) match(r.pattern, segs, params);
      break;
    }
    if (!found.allow.empty()) found.allow += ", ";
    found.allow += http::allow_entry(r.method);
    all_open = all_open && r.auth == Auth::none;
  }
  found.open_path = !found.allow.empty() && all_open;
  return found;
}

// Whether the request needs no token: the open endpoints, and other methods on their paths.
bool open_to(const Found& found, const Peer& peer) {
  if (!found.route) return found.open_path;
  return found.route->auth == Auth::none || (found.route->auth == Auth::metrics && peer.loopback);
}

} // namespace

std::size_t body_limit_for(std::string_view target) {
  // Asked for every request before its body is read: only the rows with a larger limit are
  // looked at, and a pattern without parameters is compared with the path as it came.
  const std::string_view path = target.substr(0, target.find('?'));
  std::size_t limit = k_body_limit;
  for (const auto& r : k_routes) {
    if (r.body_limit <= limit) continue;
    if (r.pattern.find('{') == std::string_view::npos) {
      if (path == r.pattern) limit = r.body_limit;
    } else if (auto u = boost::urls::parse_origin_form(target); u && match(r.pattern, segments_of(*u))) {
      limit = r.body_limit;
    }
  }
  return limit;
}

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

Router::Router(Store& store, double rate_limit)
    : m_service(store), m_tokens(store), m_health(store), m_limiter(rate_limit), m_auth_failures(5) {}

Router::~Router() = default;

http::BodyPlan Router::plan(const http::RequestHeader& header, const Peer& peer) {
  http::BodyPlan plan;
  plan.limit = body_limit_for(header.target());
  // A body announced over the limit is refused before it is read, and a request without a
  // valid token is refused for that first (SPEC §6): 401, not 413.
  std::uint64_t length = 0;
  const std::string_view announced = header[bhttp::field::content_length];
  if (std::from_chars(announced.data(), announced.data() + announced.size(), length).ec == std::errc() &&
      length > plan.limit) {
    Found found = find_route(header.target(), header.method());
    if (!open_to(found, peer))
      if (auto auth = check_bearer(header, m_tokens, m_auth_failures); !auth) plan.refuse = std::move(auth.error());
  }
  return plan;
}

void Router::handle(http::Request&& req, const Peer& peer, std::shared_ptr<http::BodySink>, http::Responder responder) {
  const int fd = responder.native_handle();
  dispatch(
      std::move(req), peer, [responder](HttpResponse&& res) { responder.send(std::move(res)); }, fd);
}

void Router::handle(HttpRequest&& req, const Peer& peer, Send send) {
  dispatch(std::move(req), peer, std::move(send), -1);
}

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

  // 1. Route, then the token (SPEC §6: checked before anything else): a client without a
  //    valid one learns nothing, not even which endpoints there are. Health, readiness and
  //    metrics on loopback are open.
  Found found = find_route(c->req.target(), method, &c->params, &c->query);
  // The route labels the request's metrics from here on: a 401 or a 503 of the token check
  // counts under the endpoint it was for, not as "unmatched".
  if (found.route) c->route_label = std::string(found.route->pattern);
  const bool open = open_to(found, peer);
  if (!open && !authenticate(c, m_tokens, m_auth_failures)) return;
  if (!found.parsed) return fail(c, Problem(Code::invalid_request, "malformed request target"));
  if (!found.route) {
    //  404 for unknown paths, 405 (with Allow) for known paths and other methods.
    if (found.allow.empty()) return fail(c, Problem(Code::not_found, "no such endpoint"));
    Reply r = problem_reply(Problem(Code::method_not_allowed, "this endpoint does not accept that method"),
                            c->ctx.request_id);
    r.allow = std::move(found.allow);
    return finish(c, std::move(r));
  }
  c->route = found.route;
  const Route& route = *c->route;

  if (c->req.body().size() > route.body_limit)
    return fail(c, Problem(Code::payload_too_large,
                           route.body_limit == k_body_limit ? "the body exceeds 16 KiB" : "the body is too large"));

  // 2. Scope.
  Backend backend{m_service, m_health};
  if (open) return route.handler(c, backend);
  bool need_admin = route.auth == Auth::admin || route.auth == Auth::metrics;
  if ((need_admin && !c->ctx.auth.scope_admin) || (!need_admin && !c->ctx.auth.scope_lease))
    return fail(c, Problem(Code::forbidden,
                           need_admin ? "this endpoint needs the admin scope" : "this token lacks the lease scope"));

  // 3. Rate limit per token. Renewals and releases go first: every other request leaves a
  // fifth of the bucket to them, so a storm of claims (or of waiting claims' retries) from
  // one daemon does not cost it the leases it holds.
  const double reserve = route.priority == Priority::keeps_leases ? 0.0 : std::max(1.0, m_limiter.rate() / 5);
  if (int wait = m_limiter.acquire(c->ctx.auth.token_id, reserve); wait > 0) {
    Metrics::global().inc("mep_rate_limited_total");
    Problem p(Code::rate_limited, "too many requests for this token");
    p.retry_after_s = wait;
    return fail(c, std::move(p));
  }

  // 4. The migration gate, then the handler.
  if (route.gate == Gate::migration && m_health.migration_in_progress()) {
    Problem gate(Code::migration_in_progress,
                 "a legacy migration is in progress; leases resume after 'mep migrate activate'");
    gate.retry_after_s = 5;
    return fail(c, std::move(gate));
  }
  route.handler(c, backend);
}

} // namespace mep::server
