// The control plane's route table and handlers: HTTP request in, Store call, HTTP
// response out (SPEC §6). Handlers decode and validate; the Store runs the transaction.
#pragma once
#include "mep/http/edge.hpp"
#include "mep/rate_limit.hpp"
#include "mep/store.hpp"

#include <functional>
#include <string>
#include <string_view>

namespace mep::server {

using HttpRequest = http::Request;
using HttpResponse = http::Response;
using Send = std::function<void(HttpResponse&&)>;
using Peer = http::Peer;

inline constexpr std::size_t k_body_limit = 16 * 1024;
/// renew-batch carries up to 1000 leases (~250 bytes each), which cannot fit in 16 KiB:
/// the parser admits this much, and the router holds every other route to k_body_limit.
inline constexpr std::size_t k_batch_body_limit = 512 * 1024;
inline constexpr std::size_t k_header_limit = 8 * 1024;

/// The largest body a request to `target` (a path, maybe with a query) may carry.
inline std::size_t body_limit_for(std::string_view target) {
  return target.substr(0, target.find('?')) == "/v1/leases/renew-batch" ? k_batch_body_limit : k_body_limit;
}

class Router final : public http::Handler {
public:
  Router(Store& store, double rate_limit) : m_store(store), m_limiter(rate_limit), m_auth_failures(5) {}

  /// Answers `req`; `send` is called exactly once, possibly from another thread.
  void handle(HttpRequest&& req, const Peer& peer, Send send);

  // http::Handler: the route's body limit, then handle() above.
  http::BodyPlan plan(const http::RequestHeader& header, const Peer& peer) override;
  void handle(http::Request&& req, const Peer& peer, std::shared_ptr<http::BodySink> sink,
              http::Responder responder) override;

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
