// Credentials for Cloud Spanner (see auth.hpp).
#include "mep/spanner/auth.hpp"

#include "mep/json.hpp"
#include "mep/time.hpp"

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace mep::server::spanner {
namespace json = boost::json;

namespace {

std::string base64url(std::string_view data) {
  std::string out(4 * ((data.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(data.data()), static_cast<int>(data.size()));
  out.resize(static_cast<std::size_t>(n));
  for (char& c : out) {
    if (c == '+') c = '-';
    if (c == '/') c = '_';
  }
  while (!out.empty() && out.back() == '=') out.pop_back();
  return out;
}

// RS256: RSASSA-PKCS1-v1_5 with SHA-256 over `data`; empty when the key cannot sign.
std::string rs256(const std::string& pem, std::string_view data) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  if (!bio) return {};
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr),
                                                          EVP_PKEY_free);
  if (!key) return {};
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  std::size_t len = 0;
  if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key.get()) != 1 ||
      EVP_DigestSign(ctx.get(), nullptr, &len, reinterpret_cast<const unsigned char*>(data.data()), data.size()) != 1)
    return {};
  std::string sig(len, '\0');
  if (EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(sig.data()), &len,
                     reinterpret_cast<const unsigned char*>(data.data()), data.size()) != 1)
    return {};
  sig.resize(len);
  return sig;
}

std::string form_encode(std::string_view s) {
  static constexpr char hex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  return out;
}

RpcError auth_error(std::string message) {
  RpcError e;
  e.kind = Failure::unauthenticated;
  e.grpc_code = 16;
  e.message = std::move(message);
  return e;
}

// {access_token, expires_in} from a token endpoint's answer.
Rpc<std::pair<std::string, std::int64_t>> read_token_answer(const http::ClientResponse& res, std::string_view who) {
  if (res.status == 0) {
    RpcError e;
    e.kind = Failure::unavailable;
    e.grpc_code = 14;
    e.message = std::string(who) + " could not be reached: " + res.error;
    return make_unexpected(std::move(e));
  }
  if (!res.ok()) {
    // The body may say why ("invalid_grant"); it holds no secret of ours.
    return make_unexpected(auth_error(std::string(who) + " refused the request (" + std::to_string(res.status) +
                                      "): " + res.body.substr(0, 200)));
  }
  auto o = mep::json::parse_object(res.body, "the token answer");
  if (!o) return make_unexpected(auth_error(std::string(who) + " answered something that is not JSON"));
  auto* tok = o->if_contains("access_token");
  auto* exp = o->if_contains("expires_in");
  if (!tok || !tok->is_string() || tok->get_string().empty() || !exp || !exp->is_number())
    return make_unexpected(auth_error(std::string(who) + " answered without access_token and expires_in"));
  return std::make_pair(std::string(tok->get_string()), exp->to_number<std::int64_t>());
}

} // namespace

// ---- refreshing ------------------------------------------------------------------------------------

RefreshingTokens::RefreshingTokens(std::function<std::int64_t()> now_s) : m_now(std::move(now_s)) {}

std::int64_t RefreshingTokens::now() const { return m_now ? m_now() : now_unix_ms() / 1000; }

int RefreshingTokens::fetches() const {
  std::lock_guard lock(m_mutex);
  return m_fetches;
}

Rpc<std::optional<std::string>> RefreshingTokens::token() {
  {
    std::lock_guard lock(m_mutex);
    if (!m_token.empty() && now() < m_refresh_at) return std::optional<std::string>(m_token);
  }
  std::lock_guard fetching(m_fetching);
  {
    // Another caller may have fetched while this one waited.
    std::lock_guard lock(m_mutex);
    if (!m_token.empty() && now() < m_refresh_at) return std::optional<std::string>(m_token);
  }
  auto got = fetch();
  std::lock_guard lock(m_mutex);
  if (!got) {
    // The token in hand serves until it really expires.
    if (!m_token.empty() && now() < m_expires_at) return std::optional<std::string>(m_token);
    return make_unexpected(std::move(got.error()));
  }
  const std::int64_t t = now();
  m_token = std::move(got->access_token);
  m_expires_at = t + got->expires_in_s;
  m_refresh_at = t + std::max<std::int64_t>(1, std::min(got->expires_in_s - k_refresh_margin_s, got->expires_in_s / 2));
  ++m_fetches;
  return std::optional<std::string>(m_token);
}

// ---- the metadata server -------------------------------------------------------------------------

MetadataTokens::MetadataTokens(Transport& transport, std::string host, std::function<std::int64_t()> now_s)
    : RefreshingTokens(std::move(now_s)), m_transport(transport), m_host(std::move(host)) {}

Rpc<RefreshingTokens::Fetched> MetadataTokens::fetch() {
  http::ClientRequest req;
  req.url = "http://" + m_host + "/computeMetadata/v1/instance/service-accounts/default/token";
  req.headers.emplace_back("Metadata-Flavor", "Google");
  req.timeout = std::chrono::seconds(5);
  auto r = read_token_answer(m_transport.perform(req), "the metadata server");
  if (!r) return make_unexpected(std::move(r.error()));
  return Fetched{std::move(r->first), r->second};
}

// ---- a service account's key --------------------------------------------------------------------

expected<ServiceAccountKey, std::string> parse_service_account_key(std::string_view json_text) {
  auto o = mep::json::parse_object(json_text, "the key file");
  if (!o) return make_unexpected(std::string("the key file is not a JSON object"));
  auto str = [&](std::string_view k) -> std::string {
    auto* v = o->if_contains(k);
    return v && v->is_string() ? std::string(v->get_string()) : std::string();
  };
  if (auto type = str("type"); type != "service_account")
    return make_unexpected("the key file's type is \"" + type + "\"; only \"service_account\" keys are supported");
  ServiceAccountKey key;
  key.client_email = str("client_email");
  key.private_key_pem = str("private_key");
  key.private_key_id = str("private_key_id");
  if (auto uri = str("token_uri"); !uri.empty()) key.token_uri = uri;
  if (key.client_email.empty() || key.private_key_pem.empty())
    return make_unexpected(std::string("the key file lacks client_email or private_key"));
  if (key.token_uri.rfind("https://", 0) != 0)
    return make_unexpected(std::string("the key file's token_uri must be https://"));
  return key;
}

std::string service_account_jwt(const ServiceAccountKey& key, std::int64_t now_s) {
  json::object header{{"alg", "RS256"}, {"typ", "JWT"}};
  if (!key.private_key_id.empty()) header["kid"] = key.private_key_id;
  json::object claims{{"iss", key.client_email},
                      {"scope", k_oauth_scopes},
                      {"aud", key.token_uri},
                      {"iat", now_s},
                      {"exp", now_s + 3600}};
  const std::string signing_input = base64url(json::serialize(header)) + "." + base64url(json::serialize(claims));
  const std::string sig = rs256(key.private_key_pem, signing_input);
  if (sig.empty()) return {};
  return signing_input + "." + base64url(sig);
}

ServiceAccountTokens::ServiceAccountTokens(Transport& transport, ServiceAccountKey key,
                                           std::function<std::int64_t()> now_s)
    : RefreshingTokens(std::move(now_s)), m_transport(transport), m_key(std::move(key)) {}

Rpc<RefreshingTokens::Fetched> ServiceAccountTokens::fetch() {
  const std::string jwt = service_account_jwt(m_key, now());
  if (jwt.empty())
    return make_unexpected(auth_error("the service account's private key cannot sign (not an RSA key?)"));
  http::ClientRequest req;
  req.method = "POST";
  req.url = m_key.token_uri;
  req.headers.emplace_back("Content-Type", "application/x-www-form-urlencoded");
  req.body = "grant_type=" + form_encode("urn:ietf:params:oauth:grant-type:jwt-bearer") + "&assertion=" + jwt;
  req.timeout = std::chrono::seconds(10);
  auto r = read_token_answer(m_transport.perform(req), "the token endpoint");
  if (!r) return make_unexpected(std::move(r.error()));
  return Fetched{std::move(r->first), r->second};
}

std::unique_ptr<TokenSource> default_tokens(const std::string& endpoint, Transport& transport) {
  if (endpoint.rfind("http://", 0) == 0) return std::make_unique<NoTokens>();
  if (const char* file = std::getenv("GOOGLE_APPLICATION_CREDENTIALS"); file && *file) {
    std::ifstream in(file);
    if (!in) throw std::runtime_error("cannot read GOOGLE_APPLICATION_CREDENTIALS (" + std::string(file) + ")");
    std::stringstream text;
    text << in.rdbuf();
    auto key = parse_service_account_key(text.str());
    if (!key) throw std::runtime_error("GOOGLE_APPLICATION_CREDENTIALS: " + key.error());
    return std::make_unique<ServiceAccountTokens>(transport, std::move(*key));
  }
  const char* host = std::getenv("GCE_METADATA_HOST");
  return std::make_unique<MetadataTokens>(transport, host && *host ? host : "metadata.google.internal");
}

} // namespace mep::server::spanner
