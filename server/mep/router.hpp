// The control plane's HTTP edge (SPEC §6): the route table and its handlers. A handler
// decodes and validates the request, calls the LeaseService (which calls the Store, where
// the transaction runs) and encodes the typed outcome.
#pragma once
#include "mep/http/edge.hpp"
#include "mep/lease_service.hpp"
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

/// The largest body a request to `target` (a path, maybe with a query) may carry: the
/// largest of the routes its path matches.
std::size_t body_limit_for(std::string_view target);

class Router final : public http::Handler {
public:
  /// Serves `store` through a LeaseService of its own, which listens to the store's
  /// releases (Store::set_freed_listener): the store must be closed (or its listener
  /// cleared) before the router is destroyed.
  Router(Store& store, double rate_limit);
  ~Router() override;

  /// Answers `req`; `send` is called exactly once, possibly from another thread.
  void handle(HttpRequest&& req, const Peer& peer, Send send);
  /// The same; a claim that waits (Prefer: wait) ends when `watch_fd` reports POLLRDHUP or
  /// POLLHUP (the client went away). -1: nothing to watch.
  void handle(HttpRequest&& req, const Peer& peer, Send send, int watch_fd) {
    dispatch(std::move(req), peer, std::move(send), watch_fd);
  }

  // http::Handler: the route's body limit, then handle() above.
  http::BodyPlan plan(const http::RequestHeader& header, const Peer& peer) override;
  void handle(http::Request&& req, const Peer& peer, std::shared_ptr<http::BodySink> sink,
              http::Responder responder) override;

  /// Ends the claims that wait (Prefer: wait) with 503 and Retry-After; new ones get 503.
  /// The server calls it when it begins to shut down.
  void end_waits() { m_service.end_waits(); }
  /// The service the routes call (for its settings: LeaseService::set_max_hold).
  LeaseService& service() { return m_service; }

private:
  LeaseService m_service;
  TokenStore& m_tokens;
  StoreHealth& m_health;
  RateLimiter m_limiter;
  // AUTH_FAILED audit rows are written at most 5 a second: an unauthenticated flood must
  // not turn into unbounded database writes (every failure still counts in the metric).
  RateLimiter m_auth_failures;

  void dispatch(HttpRequest&& req, const Peer& peer, Send send, int fd);
};

/// Parses an Idempotency-Key value (bare, or an RFC 8941 sf-string); nullopt if invalid.
std::optional<std::string> parse_idempotency_key(std::string_view value);

} // namespace mep::server
