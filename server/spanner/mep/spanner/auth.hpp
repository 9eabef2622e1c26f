// Credentials for Cloud Spanner: OAuth 2.0 access tokens from the GCE/GKE metadata server,
// or from a service account's key file (GOOGLE_APPLICATION_CREDENTIALS: an RS256-signed
// JWT exchanged at the key's token_uri, RFC 7523), refreshed before they expire; none for
// the emulator on a loopback http:// endpoint.
#pragma once
#include "mep/spanner/rest.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace mep::server::spanner {

/// The scopes asked for: data (sessions, SQL, commits) and admin (the schema's DDL).
inline constexpr const char* k_oauth_scopes =
    "https://www.googleapis.com/auth/spanner.data https://www.googleapis.com/auth/spanner.admin";
/// A token is replaced this long before it expires.
inline constexpr std::int64_t k_refresh_margin_s = 300;

/// No credentials (the emulator).
class NoTokens final : public TokenSource {
public:
  Rpc<std::optional<std::string>> token() override { return std::optional<std::string>(); }
};

/// A token that is fetched, kept, and fetched again `k_refresh_margin_s` before it expires
/// (or halfway through its life, when that is shorter). One fetch at a time; callers meanwhile
/// use the token they have while it is still valid.
class RefreshingTokens : public TokenSource {
public:
  /// `now_s`: the clock (seconds since the epoch), given by tests.
  explicit RefreshingTokens(std::function<std::int64_t()> now_s = nullptr);
  Rpc<std::optional<std::string>> token() override;
  /// How many tokens were fetched (for tests and logs).
  int fetches() const;

protected:
  struct Fetched {
    std::string access_token;
    std::int64_t expires_in_s = 0;
  };
  /// One fetch of a new token.
  virtual Rpc<Fetched> fetch() = 0;
  std::int64_t now() const;

private:
  std::function<std::int64_t()> m_now;
  mutable std::mutex m_mutex; // guards the fields below
  std::mutex m_fetching;      // one fetch at a time (held across the fetch, not m_mutex)
  std::string m_token;
  std::int64_t m_expires_at = 0; // seconds since the epoch
  std::int64_t m_refresh_at = 0;
  int m_fetches = 0;
};

/// Tokens of the instance's service account from the metadata server
/// (http://metadata.google.internal, or $GCE_METADATA_HOST), on GCE, GKE and Cloud Run.
class MetadataTokens final : public RefreshingTokens {
public:
  MetadataTokens(Transport& transport, std::string host, std::function<std::int64_t()> now_s = nullptr);

private:
  Rpc<Fetched> fetch() override;
  Transport& m_transport;
  std::string m_host;
};

/// A service account's key (the JSON file Google hands out).
struct ServiceAccountKey {
  std::string client_email;
  std::string private_key_pem;
  std::string private_key_id;
  std::string token_uri = "https://oauth2.googleapis.com/token";
};

/// Reads a key file; an error message says what is wrong (never the key).
expected<ServiceAccountKey, std::string> parse_service_account_key(std::string_view json_text);

/// The RS256 JWT a service account presents to `token_uri` (RFC 7523 §2.1): header with the
/// key id, and iss, scope, aud, iat, exp = iat + 3600. Empty on a key OpenSSL cannot use.
std::string service_account_jwt(const ServiceAccountKey& key, std::int64_t now_s);

/// Tokens for a service account, by JWT exchange at its token_uri.
class ServiceAccountTokens final : public RefreshingTokens {
public:
  ServiceAccountTokens(Transport& transport, ServiceAccountKey key, std::function<std::int64_t()> now_s = nullptr);

private:
  Rpc<Fetched> fetch() override;
  Transport& m_transport;
  ServiceAccountKey m_key;
};

/// The credentials for `endpoint`: none for http:// (the emulator, loopback only), else a
/// key file named by $GOOGLE_APPLICATION_CREDENTIALS, else the metadata server. Throws
/// std::runtime_error for an unreadable or malformed key file.
std::unique_ptr<TokenSource> default_tokens(const std::string& endpoint, Transport& transport);

} // namespace mep::server::spanner
