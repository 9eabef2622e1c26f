// mepd's socket API on the HTTP edge (SPEC §7, §8): who may connect, the body limit, and
// one route table whose handlers decode a request, call the DaemonService and encode its
// result as JSON or an RFC 9457 problem. Bound to a DaemonService only, so the whole path
// from a parsed request to its answer runs on a fake in tests and the fuzz target.
#pragma once
#include "mep/daemon_api/types.hpp"
#include "mep/daemon_service.hpp"
#include "mep/http/edge.hpp"
#include "mep/problem.hpp"

#include <boost/asio/thread_pool.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mep::daemon {

/// The largest request body mepd reads (413 beyond).
inline constexpr std::size_t k_daemon_body_limit = 16 * 1024;

class DaemonHandler final : public http::Handler {
public:
  /// `allowed` decides which peers are served (LocalServer: SO_PEERCRED's uid and group).
  /// `service` must outlive the io_context the handler's sessions run on: an event stream
  /// still open when that io_context is destroyed unsubscribes from it then.
  DaemonHandler(DaemonService& service, std::function<bool(const http::Peer&)> allowed);
  ~DaemonHandler() override;

  std::optional<Problem> admit(const http::Peer& peer) override;
  http::BodyPlan plan(const http::RequestHeader&, const http::Peer&) override;
  /// GET /v1/events becomes a stream; every other request runs respond() on the worker
  /// pool (or, for an attach that may wait, on a thread of its own).
  void handle(http::Request&& req, const http::Peer& peer, std::shared_ptr<http::BodySink>,
              http::Responder responder) override;

  /// The answer to one request, as the peer, on the calling thread. Never throws: an
  /// exception from the service is a logged 500 problem. `fd` is the agent's socket (a
  /// waiting attach polls it to see the agent leave), or -1.
  http::Response respond(const http::Request& req, const http::Peer& peer, int fd);

  /// System mode: a member (a peer whose connections are counted, EdgeOptions) may have at
  /// most `n` attaches waiting at once, and none once the daemon's threads for waiting are all
  /// taken; the next is refused 429, never put on the pool, whose threads everyone needs.
  void limit_waiting_per_member(int n) { m_waiting_per_member = n; }

  /// The routes served, as "METHOD /pattern" ("GET /v1/leases/{name}"), in table order:
  /// what the API contract test (tests/contract/daemon_api.json) holds to its exchanges.
  static std::vector<std::string> route_names();

  /// Waiting attaches end (their agent counts as gone); the pool takes no more work.
  void stop();
  /// Waits for the pool and the waiting attaches to finish.
  void join();

private:
  // What a handler produces: a status and a JSON body (204: none; text: /metrics).
  struct Answer {
    int status = 200;
    boost::json::object body;
    std::optional<std::string> text;
  };
  using Out = expected<Answer, Problem>;
  struct Call {
    const http::Request& req;
    const http::Peer& peer;
    const http::Target& target;
    const std::vector<std::string>& params;
    int fd; ///< the agent's socket, for poll(2) only
  };
  using Handle = Out (DaemonHandler::*)(const Call&);
  struct Row {
    boost::beast::http::verb method;
    std::string_view pattern;
    Handle handle;
  };
  /// Built from daemon_api::k_routes, each endpoint with its member (handler_of).
  static const std::vector<Row> k_routes;
  static Handle handler_of(daemon_api::Endpoint e);

  static Answer json(int status, boost::json::object body) { return Answer{status, std::move(body), {}}; }
  template <class T, class F>
  static Out encode(expected<T, Problem> r, int status, F to) {
    if (!r) return make_unexpected(std::move(r.error()));
    return json(status, to(*r));
  }
  static http::Response response(const Out& out, const std::string& allow, unsigned version, bool keep_alive,
                                 const std::string& rid);
  static expected<boost::json::object, Problem> body(const http::Request& req);
  static bool attach_waits(const std::string& body);
  static std::optional<std::string> query(const Call& c, std::string_view key);

  void start_events(const http::Responder& responder, uid_t viewer);
  Out route(const http::Request& req, const http::Peer& peer, std::string& allow, int fd);
  bool agent_gone(int fd);
  struct LeaseOf {
    std::string name;
    std::optional<std::string> lease_id;
  };
  expected<LeaseOf, Problem> lease_of(const Call& c);
  Out on_branch_or_init(const Call& c, bool branch);

  Out on_events(const Call&);
  Out on_health(const Call&);
  Out on_metrics(const Call&);
  Out on_attach(const Call& c);
  Out on_detach(const Call& c);
  Out on_list(const Call& c);
  Out on_get(const Call& c);
  Out on_branch(const Call& c);
  Out on_init(const Call& c);
  Out on_lineage(const Call& c);
  Out on_identify(const Call& c);
  Out on_verify(const Call& c);
  Out on_sync(const Call& c);
  Out on_fetch(const Call& c);

  DaemonService& m_service;
  std::function<bool(const http::Peer&)> m_allowed;
  boost::asio::thread_pool m_work{64};
  /// Requests on the pool, being answered or queued. A worker gives its allocator cache back only when
  /// few are: under load the next request would fetch it again at once (that cost mepd a
  /// tenth of its CPU at 64 agents), and once the load falls the last ones still return it.
  std::atomic<int> m_busy{0};
  static constexpr int k_release_below = 4;
  std::atomic<std::int64_t> m_last_release_ms{0}; ///< when release_free_memory last ran (steady ms)
  /// A request answered: gives the worker's cache back when few others are busy, and the
  /// page heap's free pages when none is (allocator.hpp).
  void finished() noexcept;
  static constexpr int k_max_waiting_attaches = 1024; // beyond, they queue for the pool (members: 429)
  std::mutex m_waiters_mutex;
  std::condition_variable m_waiters_done;
  int m_waiters = 0;
  int m_waiting_per_member = 0;                ///< 0: no limit (a personal daemon)
  std::unordered_map<uid_t, int> m_waiters_of; ///< the members' waiting attaches, by uid
  bool m_stopping = false;
  /// Ends a waiting attach's count (under m_waiters_mutex).
  void waiter_done(bool member, uid_t uid);
};

} // namespace mep::daemon
