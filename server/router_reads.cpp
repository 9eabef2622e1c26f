// The control plane's read, metrics and health handlers (the route table is in router.cpp).
#include "router_internal.hpp"

namespace mep::server::router_detail {

void on_get_lease(const CallPtr& c, LeaseService& svc) {
  // Bytes that are not UTF-8 (or hold NUL) name no lease; no store needs to look.
  const std::string& raw = c->params[0];
  if (!utf8::decode(raw) || raw.find('\0') != std::string::npos)
    return fail(c, Problem(Code::lease_not_found, "no live lease of this tenant under this name"));
  svc.get_lease(c->ctx, raw, answer<lease::LeaseInfo, 200>(c));
}

// A `limit` query value: digits only (no sign, no spaces), from 1 to `max`.
std::optional<std::size_t> page_limit(std::string_view v, std::size_t max) {
  if (v.empty() || v.size() > 6 || v.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  std::size_t n = 0;
  for (char ch : v) n = n * 10 + static_cast<std::size_t>(ch - '0');
  if (n < 1 || n > max) return std::nullopt;
  return n;
}

void on_history(const CallPtr& c, LeaseService& svc) {
  const std::string& raw = c->params[0];
  if (!utf8::decode(raw) || raw.find('\0') != std::string::npos)
    return fail(c, Problem(Code::invalid_request, "the name in the path is not UTF-8"));
  HistoryQuery req;
  req.canonical_name = raw;
  std::vector<std::string> seen;
  for (auto p : c->query) {
    if (std::find(seen.begin(), seen.end(), p.key) != seen.end())
      return fail(c, Problem(Code::invalid_request, "query parameter \"" + std::string(p.key) + "\" given twice"));
    seen.emplace_back(p.key);
    if (p.key == "since") {
      auto t = parse_rfc3339(p.value);
      if (!t) return fail(c, Problem(Code::invalid_request, "since must be an RFC 3339 time"));
      req.since = *t;
    } else if (p.key == "cursor") {
      if (p.value.empty() || p.value.size() > 64)
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
  svc.history(c->ctx, std::move(req), answer<lease::HistoryPage, 200>(c));
}

void on_list_leases(const CallPtr& c, LeaseService& svc) {
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
  svc.list_leases(c->ctx, std::move(req), answer<lease::LeasePage, 200>(c));
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

void on_get_memory(const CallPtr& c, LeaseService& svc) {
  std::string id;
  if (uuid_param(c, id)) svc.get_memory(c->ctx, id, answer<lease::Memory, 200>(c));
}

void on_lineage(const CallPtr& c, LeaseService& svc) {
  std::string id;
  if (uuid_param(c, id)) svc.lineage(c->ctx, id, answer<lease::Lineage, 200>(c));
}

void on_identity_map(const CallPtr& c, LeaseService& svc) {
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
  svc.identity_map(c->ctx, std::move(cursor), limit, answer<lease::IdentityMapPage, 200>(c));
}

// The tenants mep_leases_active_by_tenant names (its cardinality's bound).
constexpr std::size_t k_max_tenant_series = 20;

// A label value as the text exposition format writes it: \, " and newlines escaped.
std::string prometheus_label_value(std::string_view v) {
  std::string out;
  for (char ch : v) {
    if (ch == '\\' || ch == '"')
      out += '\\', out += ch;
    else if (ch == '\n')
      out += "\\n";
    else
      out += ch;
  }
  return out;
}

void on_metrics(const CallPtr& c, StoreHealth& health) {
  auto& m = Metrics::global();
  try {
    m.set("mep_db_ready", health.ready() ? 1.0 : 0.0);
    m.set("mep_leases_active", static_cast<double>(health.active_leases()));
    // At most 20 tenants by name, the busiest; the rest together as _other.
    auto by_tenant = health.active_leases_by_tenant();
    std::sort(by_tenant.begin(), by_tenant.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    std::vector<std::pair<std::string, double>> series;
    double other = 0;
    for (std::size_t i = 0; i < by_tenant.size(); ++i) {
      if (i < k_max_tenant_series)
        series.emplace_back("tenant=\"" + prometheus_label_value(by_tenant[i].first) + "\"",
                            static_cast<double>(by_tenant[i].second));
      else
        other += static_cast<double>(by_tenant[i].second);
    }
    if (by_tenant.size() > k_max_tenant_series) series.emplace_back("tenant=\"_other\"", other);
    m.replace("mep_leases_active_by_tenant", series);
    m.set("mep_db_transaction_retries_total", static_cast<double>(health.transaction_retries()));
    m.set("mep_clock_steps_total", static_cast<double>(health.clock_steps()));
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

void on_health(const CallPtr& c, bool readiness, StoreHealth& health) {
  bool ok = !readiness || health.ready();
  if (ok) {
    Reply r;
    r.body = json::dump(boost::json::object{{"status", "ok"}});
    return finish(c, std::move(r));
  }
  Problem p(Code::unavailable, "the database cannot be read or written (unreachable, full or failing)");
  p.retry_after_s = 1;
  fail(c, std::move(p));
}

// The token has the admin scope (the route's row checked it): for a data plane that lets
// only admins read what it guards itself (mep store --strict: its /metrics).
void on_admin_check(const CallPtr& c, LeaseService&) {
  Reply r;
  r.status = 204;
  finish(c, std::move(r));
}

void on_healthz(const CallPtr& c, StoreHealth& health) { on_health(c, false, health); }
void on_readyz(const CallPtr& c, StoreHealth& health) { on_health(c, true, health); }

} // namespace mep::server::router_detail
