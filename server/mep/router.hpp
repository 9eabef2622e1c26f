// The control plane's route table and handlers: HTTP request in, Store call, HTTP
// response out (SPEC §6). Handlers decode and validate; the Store runs the transaction.
#pragma once
#include "mep/rate_limit.hpp"
#include "mep/store.hpp"

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>

#include <functional>
#include <string>
#include <string_view>

namespace mep::server {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpResponse = boost::beast::http::response<boost::beast::http::string_body>;
using Send = std::function<void(HttpResponse&&)>;

inline constexpr std::size_t k_body_limit = 16 * 1024;
/// renew-batch carries up to 1000 leases (~250 bytes each), which cannot fit in 16 KiB:
/// the parser admits this much, and the router holds every other route to k_body_limit.
inline constexpr std::size_t k_batch_body_limit = 512 * 1024;
inline constexpr std::size_t k_header_limit = 8 * 1024;

/// The largest body a request to `target` (a path, maybe with a query) may carry.
inline std::size_t body_limit_for(std::string_view target) {
  return target.substr(0, target.find('?')) == "/v1/leases/renew-batch" ? k_batch_body_limit : k_body_limit;
}

/// A route's method as the Allow header of a 405 names it: GET routes answer HEAD too.
inline std::string allow_entry(boost::beast::http::verb v) {
  return v == boost::beast::http::verb::get ? "GET, HEAD" : std::string(boost::beast::http::to_string(v));
}

/// What the router knows about the peer.
struct Peer {
  bool loopback = false;
};

class Router {
public:
  Router(Store& store, double rate_limit) : m_store(store), m_limiter(rate_limit), m_auth_failures(5) {}

  /// Answers `req`; `send` is called exactly once, possibly from another thread.
  void handle(HttpRequest&& req, const Peer& peer, Send send);

  /// A problem response for errors found before routing (parser errors, limits).
  static HttpResponse problem_response(const Problem& p, unsigned version, bool keep_alive);

private:
  Store& m_store;
  RateLimiter m_limiter;
  // AUTH_FAILED audit rows are written at most 5 a second: an unauthenticated flood must
  // not turn into unbounded database writes (every failure still counts in the metric).
  RateLimiter m_auth_failures;
};

/// Parses an Idempotency-Key value (bare, or an RFC 8941 sf-string); nullopt if invalid.
std::optional<std::string> parse_idempotency_key(std::string_view value);

} // namespace mep::server
