// The control plane's router against a FakeStore (tests/support/fake_store.hpp): every
// route's method, authentication and scope, body limits and media type, the JSON rules,
// the Idempotency-Key, the migration gate, and that every refusal is a problem with the
// status of its code — without a socket, in milliseconds.
#include "../../support/fake_store.hpp"
#include "mep/json.hpp"
#include "mep/router.hpp"

#include <boost/beast/http.hpp>
#include <catch2/catch.hpp>

#include <string>

namespace bhttp = boost::beast::http;
using mep::server::HttpRequest;
using mep::server::HttpResponse;
using mep::server::Router;
using mep::test::FakeStore;

namespace {

struct Answer {
  int status = 0;
  boost::json::object body;
  HttpResponse res;
};

class Harness {
public:
  Harness() : router(store, 0) {}

  Answer call(bhttp::verb method, std::string target, std::string body = {}, std::string token = FakeStore::k_token,
              std::string idem = {}, std::string content_type = "application/json", bool loopback = true) {
    HttpRequest req{method, target, 11};
    req.set(bhttp::field::host, "test");
    if (!token.empty()) req.set(bhttp::field::authorization, "Bearer " + token);
    if (!idem.empty()) req.set("Idempotency-Key", idem);
    if (!body.empty()) req.set(bhttp::field::content_type, content_type);
    req.body() = body;
    req.prepare_payload();
    int answers = 0;
    Answer a;
    router.handle(std::move(req), mep::server::Peer{loopback}, [&](HttpResponse&& res) {
      ++answers;
      a.res = std::move(res);
    });
    REQUIRE(answers == 1);
    a.status = static_cast<int>(a.res.result_int());
    if (!a.res.body().empty() && a.res[bhttp::field::content_type] != "text/plain; version=0.0.4; charset=utf-8") {
      auto o = mep::json::parse_object(a.res.body());
      REQUIRE(o);
      a.body = *o;
    }
    if (a.status >= 400) {
      REQUIRE(a.res[bhttp::field::content_type] == "application/problem+json");
      REQUIRE(a.body.at("status").as_int64() == a.status);
      auto code = mep::code_from_slug(a.body.at("code").as_string());
      REQUIRE(code);
      REQUIRE(mep::code_info(*code).http_status == a.status);
      REQUIRE(a.res["X-Request-Id"] == a.body.at("instance").as_string());
    }
    return a;
  }

  std::string code(const Answer& a) {
    return a.body.contains("code") ? std::string(a.body.at("code").as_string()) : "";
  }

  std::string new_memory() {
    auto a = call(bhttp::verb::post, "/v1/memories", "{}", FakeStore::k_token, "reg-" + std::to_string(++m_keys));
    REQUIRE(a.status == 201);
    return std::string(a.body.at("memory_instance_id").as_string());
  }

  FakeStore store;
  Router router;

private:
  int m_keys = 0;
};

} // namespace

TEST_CASE("router: every route answers its method, and 405 names the others", "[router]") {
  Harness h;
  struct Row {
    bhttp::verb method;
    const char* target;
    const char* allow; // on a wrong method
  };
  const Row rows[] = {
      {bhttp::verb::get, "/healthz", "GET, HEAD"},
      {bhttp::verb::get, "/readyz", "GET, HEAD"},
      // "renew", "renew-batch" and "release" are also valid agent names, so GET
      // /v1/leases/{canonical_name} matches them too and Allow says so.
      {bhttp::verb::post, "/v1/leases/renew", "POST, GET, HEAD"},
      {bhttp::verb::post, "/v1/leases/renew-batch", "POST, GET, HEAD"},
      {bhttp::verb::post, "/v1/leases/release", "POST, GET, HEAD"},
      {bhttp::verb::post, "/v1/fence/verify", "POST"},
      {bhttp::verb::post, "/v1/admin/leases/revoke", "POST"},
      {bhttp::verb::get, "/v1/migration/identity-map", "GET, HEAD"},
  };
  for (const auto& r : rows) {
    INFO(r.target);
    auto wrong = h.call(r.method == bhttp::verb::get ? bhttp::verb::delete_ : bhttp::verb::put, r.target);
    REQUIRE(wrong.status == 405);
    REQUIRE(wrong.res[bhttp::field::allow] == r.allow);
  }
  // Both methods of /v1/leases, and of the two memory paths.
  REQUIRE(h.call(bhttp::verb::delete_, "/v1/leases").res[bhttp::field::allow] == "POST, GET, HEAD");
  REQUIRE(h.call(bhttp::verb::get, "/v1/leases").status == 200);
  REQUIRE(h.call(bhttp::verb::get, "/no/such/path").status == 404);
  REQUIRE(h.code(h.call(bhttp::verb::get, "/no/such/path")) == "not-found");
}

TEST_CASE("router: authentication before anything else, scopes per route", "[router]") {
  Harness h;
  for (auto token : {std::string(), std::string("mep_wrong"), std::string("x")}) {
    auto a = h.call(bhttp::verb::get, "/v1/leases", {}, token);
    REQUIRE(a.status == 401);
    REQUIRE(std::string(a.res[bhttp::field::www_authenticate]).rfind("Bearer", 0) == 0);
  }
  const int before = h.store.calls;
  REQUIRE(h.call(bhttp::verb::post, "/v1/leases", R"({"display_name":"a"})", "nope", "k").status == 401);
  REQUIRE(h.store.calls == before); // refused before the store is asked
  // Health needs no token; metrics none on loopback, the admin scope beyond it.
  REQUIRE(h.call(bhttp::verb::get, "/healthz", {}, {}).status == 200);
  REQUIRE(h.call(bhttp::verb::get, "/metrics", {}, {}).status == 200);
  REQUIRE(h.call(bhttp::verb::get, "/metrics", {}, {}, {}, "application/json", false).status == 401);
  REQUIRE(h.call(bhttp::verb::get, "/metrics", {}, FakeStore::k_token, {}, "application/json", false).status == 200);
}

TEST_CASE("router: bodies — media type, syntax, unknown and duplicate fields, types", "[router]") {
  Harness h;
  const std::string mem = h.new_memory();
  const std::string good = R"({"display_name":"My Agent","memory_instance_id":")" + mem + R"(","owner_client_id":"o"})";
  REQUIRE(h.call(bhttp::verb::post, "/v1/leases", good, FakeStore::k_token, "c1").status == 201);
  struct Bad {
    std::string body, content_type;
    int status;
    const char* code;
  };
  const Bad bad[] = {
      {good, "text/plain", 415, "unsupported-media-type"},
      {"{nope", "application/json", 400, "invalid-request"},
      {R"({"display_name":"a","display_name":"b","memory_instance_id":")" + mem + R"(","owner_client_id":"o"})",
       "application/json", 400, "invalid-request"},
      {R"({"display_name":"a","memory_instance_id":")" + mem + R"(","owner_client_id":"o","x":1})", "application/json",
       400, "invalid-request"},
      {R"({"display_name":1,"memory_instance_id":")" + mem + R"(","owner_client_id":"o"})", "application/json", 400,
       "invalid-request"},
      {R"({"display_name":"a","memory_instance_id":"not-a-uuid","owner_client_id":"o"})", "application/json", 400,
       "invalid-request"},
      {R"({"display_name":"a","memory_instance_id":")" + mem + R"(","owner_client_id":"o","ttl_seconds":5.5})",
       "application/json", 400, "invalid-request"},
      {R"({"display_name":"agent!","memory_instance_id":")" + mem + R"(","owner_client_id":"o"})", "application/json",
       422, "invalid-name"},
      {R"({"display_name":"a","memory_instance_id":")" + mem + R"(","owner_client_id":"o","ttl_seconds":4})",
       "application/json", 422, "invalid-ttl"},
      {"{\"display_name\":\"" + std::string(20000, 'a') + "\"}", "application/json", 413, "payload-too-large"},
  };
  int n = 0;
  for (const auto& b : bad) {
    INFO(b.body.substr(0, 120));
    auto a = h.call(bhttp::verb::post, "/v1/leases", b.body, FakeStore::k_token, "bad-" + std::to_string(++n),
                    b.content_type);
    REQUIRE(a.status == b.status);
    REQUIRE(h.code(a) == b.code);
  }
}

TEST_CASE("router: creating POSTs need a valid Idempotency-Key", "[router]") {
  Harness h;
  const std::string mem = h.new_memory();
  const std::string body = R"({"display_name":"a","memory_instance_id":")" + mem + R"(","owner_client_id":"o"})";
  auto missing = h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, {});
  REQUIRE(missing.status == 400);
  REQUIRE(h.code(missing) == "idempotency-key-missing");
  for (auto key : {std::string(256, 'k'), std::string("has space"), std::string("\"unclosed")}) {
    auto a = h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, key);
    REQUIRE(a.status == 400);
    REQUIRE(h.code(a) == "idempotency-key-invalid");
  }
  REQUIRE(h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, "\"quoted \\\" key\"").status == 201);
  // Non-creating POSTs take none.
  REQUIRE(
      h.call(bhttp::verb::post, "/v1/leases/release",
             R"({"canonical_name":"a","memory_instance_id":")" + mem + R"(","fencing_token":1,"owner_client_id":"o"})")
          .status == 204);
}

TEST_CASE("router: the migration gate closes the lease endpoints only", "[router]") {
  Harness h;
  h.store.set_migrating(true);
  auto a = h.call(bhttp::verb::post, "/v1/leases", R"({"display_name":"a"})", FakeStore::k_token, "k");
  REQUIRE(a.status == 503);
  REQUIRE(h.code(a) == "migration-in-progress");
  REQUIRE(!a.res[bhttp::field::retry_after].empty());
  REQUIRE(h.call(bhttp::verb::get, "/v1/leases").status == 200);
  REQUIRE(h.call(bhttp::verb::get, "/v1/migration/identity-map").status == 200);
}

TEST_CASE("router: a store that throws is a problem, never a crash or a second answer", "[router]") {
  Harness h;
  const std::string mem = h.new_memory();
  h.store.fail_at = h.store.calls + 1;
  const std::string body = R"({"display_name":"a","memory_instance_id":")" + mem + R"(","owner_client_id":"o"})";
  Answer a;
  bool threw = false;
  try {
    a = h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, "boom");
  } catch (const std::exception&) {
    threw = true; // the edge's exception boundary answers 500 for it; the router may let it through
  }
  if (!threw) REQUIRE(a.status >= 500);
  h.store.fail_at = 0;
  REQUIRE(h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, "after").status == 201);
}

TEST_CASE("router: a query parameter that is not UTF-8 is quoted as valid JSON", "[router]") {
  // Found by tests/fuzz/fuzz_http_request.cpp: "%da" decodes to the lone byte 0xDA.
  Harness h;
  auto a = h.call(bhttp::verb::get, "/v1/leases?own%daer=1");
  REQUIRE(a.status == 400); // the Harness parses the body as strict JSON
  REQUIRE(h.code(a) == "invalid-request");
  REQUIRE(std::string(a.body.at("detail").as_string())
              .find("own\xEF\xBF\xBD"
                    "er") != std::string::npos);
}

TEST_CASE("router: typed outcomes become the API's statuses, bodies and headers", "[router]") {
  Harness h;
  const std::string mem = h.new_memory();
  const std::string body = R"({"display_name":"Alpha","memory_instance_id":")" + mem + R"(","owner_client_id":"o"})";
  auto granted = h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, "g1");
  REQUIRE(granted.status == 201);
  REQUIRE(granted.res["Idempotent-Replayed"].empty());
  REQUIRE(granted.body.at("canonical_name").as_string() == "alpha");
  REQUIRE(granted.body.at("expires_at").as_string() == "2026-01-01T00:00:30.000Z");
  REQUIRE(granted.body.at("server_time").as_string() == "2026-01-01T00:00:00.000Z");
  REQUIRE(granted.body.at("fencing_token").as_int64() == 1);

  // A replay: 200 (nothing was created this time) and Idempotent-Replayed.
  h.store.replay = true;
  auto replayed = h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, "g1");
  REQUIRE(replayed.status == 200);
  REQUIRE(replayed.res["Idempotent-Replayed"] == "true");
  auto existing = h.call(bhttp::verb::post, "/v1/memories", "{}", FakeStore::k_token, "m1");
  REQUIRE(existing.status == 200);

  // A refusal keeps its status, its Retry-After, its extensions and the request id.
  h.store.replay = false;
  mep::Problem held(mep::Code::name_held, "held by another owner");
  held.retry_after_s = 7;
  held.extensions["reason"] = "test";
  h.store.claim_problem = held;
  auto refused = h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, "g2");
  REQUIRE(refused.status == 423);
  REQUIRE(refused.res[bhttp::field::retry_after] == "7");
  REQUIRE(refused.body.at("reason").as_string() == "test");
  REQUIRE(refused.body.at("detail").as_string() == "held by another owner");

  // A 503 always says when to retry, even when the store's problem did not.
  h.store.claim_problem = mep::Problem(mep::Code::unavailable, "the database is unavailable; retry later");
  auto unavailable = h.call(bhttp::verb::post, "/v1/leases", body, FakeStore::k_token, "g3");
  REQUIRE(unavailable.status == 503);
  REQUIRE(unavailable.res[bhttp::field::retry_after] == "1");

  // 204 without a body; a batch is 200 with one result per lease.
  auto released =
      h.call(bhttp::verb::post, "/v1/leases/release",
             R"({"canonical_name":"a","memory_instance_id":")" + mem + R"(","fencing_token":1,"owner_client_id":"o"})");
  REQUIRE(released.status == 204);
  REQUIRE(released.res.body().empty());
  auto batch = h.call(bhttp::verb::post, "/v1/leases/renew-batch",
                      R"({"owner_client_id":"o","leases":[{"canonical_name":"a","memory_instance_id":")" + mem +
                          R"(","fencing_token":1}]})");
  REQUIRE(batch.status == 200);
  REQUIRE(batch.body.at("results").as_array().size() == 1);
  REQUIRE(batch.body.at("results").as_array()[0].at("status").as_int64() == 410);
  REQUIRE(batch.body.at("results").as_array()[0].at("code").as_string() == "lease-expired");
}

TEST_CASE("router: each route's body limit is the row's", "[router]") {
  using mep::server::body_limit_for;
  REQUIRE(body_limit_for("/v1/leases") == mep::server::k_body_limit);
  REQUIRE(body_limit_for("/v1/leases/renew-batch") == mep::server::k_batch_body_limit);
  REQUIRE(body_limit_for("/v1/leases/renew-batch?x=1") == mep::server::k_batch_body_limit);
  REQUIRE(body_limit_for("/no/such/route") == mep::server::k_body_limit);
  Harness h;
  const std::string big(mep::server::k_body_limit + 1, ' ');
  REQUIRE(h.call(bhttp::verb::post, "/v1/leases/renew", "{}" + big).status == 413);
  // renew-batch takes more than 16 KiB (the edge holds it to 512 KiB).
  auto a = h.call(bhttp::verb::post, "/v1/leases/renew-batch", R"({"owner_client_id":"o","leases":[]})" + big);
  REQUIRE(a.status == 200);
}
