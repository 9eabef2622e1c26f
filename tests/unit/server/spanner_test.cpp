// The Spanner store's pure parts: errors classified by gRPC code (and the emulator's quirks),
// Spanner's timestamps, database URLs, spread keys, and the credentials — the service
// account's RS256 JWT (verified with the public key) and the refresh of tokens, on a fake
// transport and a fake clock. No network: the store itself is tested on the emulator.
#include "mep/spanner/auth.hpp"
#include "mep/spanner/rest.hpp"
#include "mep/spanner/store.hpp"

#include <boost/json.hpp>
#include <catch2/catch.hpp>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rsa.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

using namespace mep;
using namespace mep::server::spanner;
namespace json = boost::json;

namespace {

http::ClientResponse answer(int status, std::string body) {
  http::ClientResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

// A transport that records requests and answers from a script.
class FakeTransport final : public Transport {
public:
  std::vector<http::ClientRequest> requests;
  std::vector<http::ClientResponse> answers;
  http::ClientResponse perform(const http::ClientRequest& req) override {
    requests.push_back(req);
    if (answers.empty()) return answer(0, "");
    auto a = answers.front();
    answers.erase(answers.begin());
    return a;
  }
};

std::string unbase64url(std::string s) {
  for (char& c : s) {
    if (c == '-') c = '+';
    if (c == '_') c = '/';
  }
  while (s.size() % 4) s += '=';
  std::string out(s.size(), '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  REQUIRE(n >= 0);
  out.resize(static_cast<std::size_t>(n));
  while (!out.empty() && out.back() == '\0' && s.size() >= 2 && s[s.size() - 1] == '=') {
    out.pop_back();
    s.pop_back();
  }
  return out;
}

struct RsaKey {
  std::string private_pem;
  std::string public_pem;
};

RsaKey make_key() {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_RSA_gen(2048), EVP_PKEY_free);
  REQUIRE(key);
  RsaKey out;
  std::unique_ptr<BIO, decltype(&BIO_free)> priv(BIO_new(BIO_s_mem()), BIO_free);
  REQUIRE(PEM_write_bio_PrivateKey(priv.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr) == 1);
  char* data = nullptr;
  long n = BIO_get_mem_data(priv.get(), &data);
  out.private_pem.assign(data, static_cast<std::size_t>(n));
  std::unique_ptr<BIO, decltype(&BIO_free)> pub(BIO_new(BIO_s_mem()), BIO_free);
  REQUIRE(PEM_write_bio_PUBKEY(pub.get(), key.get()) == 1);
  n = BIO_get_mem_data(pub.get(), &data);
  out.public_pem.assign(data, static_cast<std::size_t>(n));
  return out;
}

bool verify_rs256(const std::string& public_pem, const std::string& input, const std::string& sig) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(public_pem.data(), static_cast<int>(public_pem.size())),
                                                BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr),
                                                          EVP_PKEY_free);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  return key && EVP_DigestVerifyInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key.get()) == 1 &&
         EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(sig.data()), sig.size(),
                          reinterpret_cast<const unsigned char*>(input.data()), input.size()) == 1;
}

std::string key_json(const RsaKey& k, std::string type = "service_account") {
  return json::serialize(json::object{{"type", type},
                                      {"client_email", "mep@project.iam.gserviceaccount.com"},
                                      {"private_key", k.private_pem},
                                      {"private_key_id", "key-1"},
                                      {"token_uri", "https://oauth2.googleapis.com/token"}});
}

} // namespace

TEST_CASE("errors are classified by gRPC code, the emulator's quirks included", "[spanner]") {
  CHECK(classify_error(answer(409, R"({"code": 10, "message": "aborted due to active transaction"})")).kind ==
        Failure::aborted);
  CHECK(classify_error(answer(409, R"({"code": 6, "message": "UNIQUE violation"})")).kind == Failure::already_exists);
  // The emulator's NOT_FOUND (a deleted session, an unknown database).
  CHECK(classify_error(answer(500, R"({"code": 13, "message": "failed to marshal error message"})")).kind ==
        Failure::not_found);
  CHECK(classify_error(answer(500, R"({"code": 13, "message": "ZETASQL_RET_CHECK failure"})")).kind ==
        Failure::internal);
  // Google's form: the status name decides, and RetryInfo's delay is kept.
  auto prod = classify_error(
      answer(409, R"({"error": {"code": 409, "message": "Transaction was aborted.", "status": "ABORTED", "details": [)"
                  R"({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.171s"}]}})"));
  CHECK(prod.kind == Failure::aborted);
  CHECK(prod.grpc_code == 10);
  REQUIRE(prod.retry_delay);
  CHECK(prod.retry_delay->count() == 171);
  CHECK(
      classify_error(answer(404, R"({"error": {"code": 404, "message": "Session not found", "status": "NOT_FOUND"}})"))
          .kind == Failure::not_found);
  CHECK(classify_error(answer(0, "")).kind == Failure::transport);
  CHECK(classify_error(answer(503, "<html>busy</html>")).kind == Failure::unavailable);
  CHECK(classify_error(answer(401, "")).kind == Failure::unauthenticated);
}

TEST_CASE("Spanner timestamps with 0 to 9 fractional digits read to the microsecond", "[spanner]") {
  CHECK(timestamp_micros("2026-12-06T19:49:48.04691Z") == std::optional<std::int64_t>(1796586588046910));
  CHECK(timestamp_micros("2026-12-06T19:49:48Z") == std::optional<std::int64_t>(1796586588000000));
  CHECK(timestamp_micros("2026-12-06T19:49:48.123456789Z") == std::optional<std::int64_t>(1796586588123456));
  CHECK_FALSE(timestamp_micros("2026-12-06T19:49:48.Z"));
  CHECK_FALSE(timestamp_micros("2026-12-06 19:49:48Z"));
  CHECK_FALSE(timestamp_micros("yesterday"));
}

TEST_CASE("a spanner: URL names the database, the endpoint comes from it, the environment or Google", "[spanner]") {
  ::unsetenv("MEP_SPANNER_ENDPOINT");
  auto a = parse_location("spanner:projects/p-1/instances/i_2/databases/d3");
  REQUIRE(a);
  CHECK(a->database == "projects/p-1/instances/i_2/databases/d3");
  CHECK(a->endpoint == "https://spanner.googleapis.com");
  auto b = parse_location("spanner:projects/p/instances/i/databases/d?endpoint=http://127.0.0.1:9020");
  REQUIRE(b);
  CHECK(b->endpoint == "http://127.0.0.1:9020");
  ::setenv("MEP_SPANNER_ENDPOINT", "http://localhost:9021/", 1);
  auto c = parse_location("spanner:projects/p/instances/i/databases/d");
  REQUIRE(c);
  CHECK(c->endpoint == "http://localhost:9021");
  ::unsetenv("MEP_SPANNER_ENDPOINT");
  for (const char* bad : {"spanner:", "spanner:projects/p/instances/i", "spanner:projects/p/instances/i/databases/",
                          "spanner:projects/P/instances/i/databases/d", "spanner:projects/p/instances/i/databases/d/x",
                          "spanner:projects/p/instances/i/databases/d?colour=red",
                          "spanner:projects/p/instances/i/databases/d?endpoint=http://example.com"}) {
    INFO(bad);
    CHECK_FALSE(parse_location(bad));
  }
}

TEST_CASE("a memory's rows are keyed by a hash prefix, not by its time-ordered id", "[spanner]") {
  const std::string id = "01a24d4a-8707-7261-8920-20d3c2cafa95";
  CHECK(spread_key(id) == spread_key(id));
  CHECK(spread_key(id).size() == 8 + id.size());
  CHECK(spread_key(id).substr(8) == id);
  CHECK(spread_key(id).substr(0, 8) != spread_key("01a24d4a-8707-7261-8920-20d3c2cafa96").substr(0, 8));
}

TEST_CASE("a service account's JWT is RS256-signed with its key and says who, for what, until when",
          "[spanner][auth]") {
  const RsaKey k = make_key();
  auto key = parse_service_account_key(key_json(k));
  REQUIRE(key);
  const std::string jwt = service_account_jwt(*key, 1'800'000'000);
  const auto dot1 = jwt.find('.'), dot2 = jwt.rfind('.');
  REQUIRE(dot1 != std::string::npos);
  REQUIRE(dot2 != dot1);
  auto header = json::parse(unbase64url(jwt.substr(0, dot1))).as_object();
  CHECK(header.at("alg") == "RS256");
  CHECK(header.at("typ") == "JWT");
  CHECK(header.at("kid") == "key-1");
  auto claims = json::parse(unbase64url(jwt.substr(dot1 + 1, dot2 - dot1 - 1))).as_object();
  CHECK(claims.at("iss") == "mep@project.iam.gserviceaccount.com");
  CHECK(claims.at("aud") == "https://oauth2.googleapis.com/token");
  CHECK(std::string(claims.at("scope").as_string()).find("spanner.data") != std::string::npos);
  CHECK(claims.at("iat").as_int64() == 1'800'000'000);
  CHECK(claims.at("exp").as_int64() == 1'800'003'600);
  CHECK(verify_rs256(k.public_pem, jwt.substr(0, dot2), unbase64url(jwt.substr(dot2 + 1))));
  // Tampered claims fail the signature.
  CHECK_FALSE(verify_rs256(k.public_pem, jwt.substr(0, dot2) + "x", unbase64url(jwt.substr(dot2 + 1))));
  // A key that cannot sign gives no JWT.
  ServiceAccountKey broken = *key;
  broken.private_key_pem = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
  CHECK(service_account_jwt(broken, 1).empty());
}

TEST_CASE("key files other than a service account's, or incomplete ones, are refused", "[spanner][auth]") {
  const RsaKey k = make_key();
  CHECK_FALSE(parse_service_account_key(key_json(k, "authorized_user")));
  CHECK_FALSE(parse_service_account_key("not json"));
  CHECK_FALSE(parse_service_account_key(R"({"type": "service_account", "client_email": "x"})"));
  auto plain = json::parse(key_json(k)).as_object();
  plain["token_uri"] = "http://oauth2.example/token";
  CHECK_FALSE(parse_service_account_key(json::serialize(plain)));
}

TEST_CASE("tokens are exchanged once, kept, and fetched again before they expire", "[spanner][auth]") {
  const RsaKey k = make_key();
  FakeTransport t;
  std::int64_t clock = 1'800'000'000;
  ServiceAccountTokens tokens(t, *parse_service_account_key(key_json(k)), [&] { return clock; });
  t.answers.push_back(answer(200, R"({"access_token": "ya29.first", "expires_in": 3599, "token_type": "Bearer"})"));
  auto first = tokens.token();
  REQUIRE(first);
  CHECK(**first == "ya29.first");
  REQUIRE(t.requests.size() == 1);
  CHECK(t.requests[0].method == "POST");
  CHECK(t.requests[0].url == "https://oauth2.googleapis.com/token");
  CHECK(t.requests[0].body.rfind("grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer&assertion=", 0) ==
        0);
  // Within its life: no new exchange.
  clock += 3000;
  REQUIRE(tokens.token());
  CHECK(tokens.fetches() == 1);
  // Within five minutes of its end: a new one.
  clock += 400;
  t.answers.push_back(answer(200, R"({"access_token": "ya29.second", "expires_in": 3599})"));
  auto second = tokens.token();
  REQUIRE(second);
  CHECK(**second == "ya29.second");
  CHECK(tokens.fetches() == 2);
  // A failing exchange while the token still holds: the token serves; once it has expired:
  // unauthenticated (with what the endpoint said).
  clock += 3400;
  t.answers.push_back(answer(400, R"({"error": "invalid_grant"})"));
  auto still = tokens.token();
  REQUIRE(still);
  CHECK(**still == "ya29.second");
  clock += 1000;
  t.answers.push_back(answer(400, R"({"error": "invalid_grant"})"));
  auto none = tokens.token();
  REQUIRE_FALSE(none);
  CHECK(none.error().kind == Failure::unauthenticated);
  CHECK(none.error().message.find("invalid_grant") != std::string::npos);
}

TEST_CASE("the metadata server is asked with Metadata-Flavor: Google, the emulator needs no token", "[spanner][auth]") {
  FakeTransport t;
  std::int64_t clock = 100;
  MetadataTokens tokens(t, "metadata.google.internal", [&] { return clock; });
  t.answers.push_back(answer(200, R"({"access_token": "ya29.gce", "expires_in": 1200})"));
  auto tok = tokens.token();
  REQUIRE(tok);
  CHECK(**tok == "ya29.gce");
  REQUIRE(t.requests.size() == 1);
  CHECK(t.requests[0].url ==
        "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token");
  CHECK(t.requests[0].headers == std::vector<std::pair<std::string, std::string>>{{"Metadata-Flavor", "Google"}});
  // A short-lived token is refreshed halfway through its life.
  clock += 601;
  t.answers.push_back(answer(200, R"({"access_token": "ya29.gce2", "expires_in": 1200})"));
  REQUIRE(tokens.token());
  CHECK(tokens.fetches() == 2);
  // Garbage from the metadata server is an error, not a token.
  MetadataTokens bad(t, "m", [&] { return clock; });
  t.answers.push_back(answer(200, R"({"token": "x"})"));
  CHECK_FALSE(bad.token());
  // The emulator: no Authorization header at all.
  FakeTransport e;
  auto none = default_tokens("http://127.0.0.1:9020", e);
  auto nt = none->token();
  REQUIRE(nt);
  CHECK_FALSE(*nt);
}

TEST_CASE("calls carry the bearer token and parse Spanner's answers", "[spanner]") {
  FakeTransport t;
  std::int64_t clock = 0;
  MetadataTokens tokens(t, "m", [&] { return clock; });
  Rest rest("https://spanner.googleapis.com/", "projects/p/instances/i/databases/d", t, tokens);
  t.answers.push_back(answer(200, R"({"access_token": "tok", "expires_in": 3600})"));
  t.answers.push_back(answer(200, R"({"name": "projects/p/instances/i/databases/d/sessions/s1"})"));
  auto s = rest.create_session();
  REQUIRE(s);
  CHECK(*s == "projects/p/instances/i/databases/d/sessions/s1");
  REQUIRE(t.requests.size() == 2);
  CHECK(t.requests[1].url == "https://spanner.googleapis.com/v1/projects/p/instances/i/databases/d/sessions");
  CHECK(std::find(t.requests[1].headers.begin(), t.requests[1].headers.end(),
                  std::pair<std::string, std::string>{"Authorization", "Bearer tok"}) != t.requests[1].headers.end());
  // A result's rows: INT64 as strings, ARRAY<STRUCT> as lists, NULL.
  const json::value result = json::parse(R"({"rows": [["42", null, [["a", "7"]]]]})"); // rows refer into it
  auto rows = rows_of(result.as_object());
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].int64(0) == 42);
  CHECK(rows[0].is_null(1));
  CHECK_FALSE(rows[0].opt_int64(1));
  auto inner = rows[0].rows(2);
  REQUIRE(inner.size() == 1);
  CHECK(inner[0].str(0) == "a");
  CHECK(inner[0].int64(1) == 7);
}
