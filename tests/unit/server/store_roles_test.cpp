// The router's consumers of the store's small roles, each against a fake of that role alone:
// authentication against a TokenStore (two methods), health, readiness and /metrics against
// a StoreHealth. No lease operations, no database.
#include "router_internal.hpp"

#include <catch2/catch.hpp>

#include <map>
#include <stdexcept>
#include <string>

namespace bhttp = boost::beast::http;
using namespace mep;
using namespace mep::server;
using namespace mep::server::router_detail;

namespace {

class FakeTokens final : public TokenStore {
public:
  std::map<std::string, AuthInfo> by_hash; // SHA-256 hex of the token -> its tenant and scopes
  bool unreachable = false;
  int lookups = 0;
  int audited = 0;

  std::optional<AuthInfo> authenticate(const std::string& token_sha256) override {
    ++lookups;
    if (unreachable) throw std::runtime_error("connection refused");
    auto it = by_hash.find(token_sha256);
    if (it == by_hash.end()) return std::nullopt;
    return it->second;
  }
  void audit_auth_failure(const std::string&) override { ++audited; }
};

class FakeHealth final : public StoreHealth {
public:
  bool answers = true;
  bool counting_fails = false;
  std::int64_t live = 0;
  std::vector<std::pair<std::string, std::int64_t>> by_tenant;

  bool ready() override { return answers; }
  std::int64_t active_leases() override {
    if (counting_fails) throw std::runtime_error("statement timeout");
    return live;
  }
  std::vector<std::pair<std::string, std::int64_t>> active_leases_by_tenant() override { return by_tenant; }
  bool migration_in_progress() override { return false; }
};

bhttp::fields bearer(const std::string& token) {
  bhttp::fields f;
  if (!token.empty()) f.set(bhttp::field::authorization, "Bearer " + token);
  return f;
}

struct Sent {
  int status = 0;
  std::string body;
  std::string retry_after;
};

// Runs a handler on a GET of `target` and returns what it sent (exactly once).
template <class F>
Sent run(const std::string& target, F handler) {
  auto c = std::make_shared<Call>();
  c->req = HttpRequest{bhttp::verb::get, target, 11};
  int sends = 0;
  Sent out;
  c->send = [&](HttpResponse&& res) {
    ++sends;
    out.status = static_cast<int>(res.result_int());
    out.body = res.body();
    out.retry_after = std::string(res[bhttp::field::retry_after]);
  };
  handler(c);
  REQUIRE(sends == 1);
  return out;
}

} // namespace

TEST_CASE("authentication: a token store alone decides who calls", "[roles]") {
  FakeTokens tokens;
  tokens.by_hash[sha256_hex("mep_good")] = AuthInfo{"tenant-1", "token-1", true, false};
  RateLimiter budget(2); // AUTH_FAILED rows: at most 2 a second

  auto ok = check_bearer(bearer("mep_good"), tokens, budget);
  REQUIRE(ok);
  CHECK(ok->tenant_id == "tenant-1");
  CHECK(ok->scope_lease);
  CHECK_FALSE(ok->scope_admin);

  // No header, or not a bearer: refused before any lookup.
  const int before = tokens.lookups;
  auto none = check_bearer(bearer(""), tokens, budget);
  REQUIRE_FALSE(none);
  CHECK(none.error().code == Code::unauthenticated);
  bhttp::fields basic;
  basic.set(bhttp::field::authorization, "Basic dXNlcjpwdw==");
  CHECK_FALSE(check_bearer(basic, tokens, budget));
  CHECK(tokens.lookups == before);

  // Unknown tokens: 401 each, audited within the budget only.
  for (int i = 0; i < 5; ++i) {
    auto unknown = check_bearer(bearer("mep_unknown"), tokens, budget);
    REQUIRE_FALSE(unknown);
    CHECK(unknown.error().code == Code::unauthenticated);
  }
  CHECK(tokens.audited == 2);

  // A lookup that fails is the database's problem, not the caller's: 503, not 401.
  tokens.unreachable = true;
  auto down = check_bearer(bearer("mep_good"), tokens, budget);
  REQUIRE_FALSE(down);
  CHECK(down.error().code == Code::unavailable);
  CHECK(tokens.audited == 2);
}

TEST_CASE("health and readiness: a store health alone decides the answers", "[roles]") {
  FakeHealth health;
  CHECK(run("/readyz", [&](const CallPtr& c) { on_readyz(c, health); }).status == 200);
  health.answers = false;
  const Sent down = run("/readyz", [&](const CallPtr& c) { on_readyz(c, health); });
  CHECK(down.status == 503);
  CHECK(down.retry_after == "1");
  CHECK(down.body.find("\"code\":\"unavailable\"") != std::string::npos);
  // Liveness does not ask the database.
  CHECK(run("/healthz", [&](const CallPtr& c) { on_healthz(c, health); }).status == 200);
}

TEST_CASE("/metrics: the gauges come from the store's health, and a failing count loses only itself", "[roles]") {
  FakeHealth health;
  health.live = 7;
  health.by_tenant = {{"acme", 5}, {"with \"quote\"", 2}};
  Sent m = run("/metrics", [&](const CallPtr& c) { on_metrics(c, health); });
  CHECK(m.status == 200);
  CHECK(m.body.find("\nmep_db_ready 1\n") != std::string::npos);
  CHECK(m.body.find("\nmep_leases_active 7\n") != std::string::npos);
  CHECK(m.body.find("mep_leases_active_by_tenant{tenant=\"acme\"} 5\n") != std::string::npos);
  CHECK(m.body.find("mep_leases_active_by_tenant{tenant=\"with \\\"quote\\\"\"} 2\n") != std::string::npos);

  health.answers = false;
  health.counting_fails = true;
  m = run("/metrics", [&](const CallPtr& c) { on_metrics(c, health); });
  CHECK(m.status == 200);
  CHECK(m.body.find("\nmep_db_ready 0\n") != std::string::npos);
}
