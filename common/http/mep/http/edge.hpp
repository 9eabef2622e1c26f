// mep's one HTTP edge (Boost.Beast): sessions over TCP, TLS 1.3 and Unix sockets, shared by
// `mep server`, `mepd` and `mep store`. The framing rules, limits, deadlines, Expect:
// 100-continue, HEAD, lingering close and the problem responses of edge-level errors are
// written here once; what a request means is the Handler's business.
#pragma once
#include "mep/problem.hpp"

#include <cstdint>
#include <optional>
#include <vector>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/http/file_body.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/verb.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <sys/types.h>
#include <vector>

namespace mep::http {

using Request = boost::beast::http::request<boost::beast::http::string_body>;
using RequestHeader = boost::beast::http::request_header<>;
using Response = boost::beast::http::response<boost::beast::http::string_body>;
/// A response whose body is a file, sent from disk (mep store's GET of an object).
using FileResponse = boost::beast::http::response<boost::beast::http::file_body>;
using Verb = boost::beast::http::verb;

inline constexpr std::size_t k_header_limit = 8 * 1024;

/// Who is on the other end of a connection.
struct Peer {
  bool loopback = false; ///< TCP from a loopback address, or any Unix-socket peer
  bool unix_socket = false;
  bool cred_known = false; ///< SO_PEERCRED answered (Unix sockets)
  pid_t pid = 0;
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
  /// SO_PEERGROUPS: the supplementary groups the peer had when it connected (Unix sockets).
  std::optional<std::vector<gid_t>> groups = std::nullopt;
  /// Unix sockets: the peer's user already holds EdgeOptions::connections_per_uid
  /// connections to this listener (the handler refuses it in admit()).
  bool over_limit = false;
  /// Counts the connection against its user's limit while any copy of the peer lives.
  std::shared_ptr<const void> counted = nullptr;
};

/// Takes a request body as it arrives, instead of in memory (PUT of an object). Called on
/// the session's strand, one call at a time.
class BodySink {
public:
  virtual ~BodySink() = default;
  /// Takes the next bytes; a problem stops the read (the request is answered with it and
  /// the connection closed), e.g. 507 on a full disk.
  virtual std::optional<Problem> write(const void* data, std::size_t size) = 0;
};

/// What a request may carry, decided from its header before any byte of the body is read.
struct BodyPlan {
  std::size_t limit = 16 * 1024;  ///< a larger body is refused with 413
  std::shared_ptr<BodySink> sink; ///< null: the body is read into Request::body()
  /// Given, the request is answered with it at once and its body is never read (401 before
  /// a large upload, 409 for a token known to be stale).
  std::optional<Problem> refuse;
};

/// A response body written as it is produced (mepd's NDJSON events), until the client
/// goes away. push() may be called from any thread.
class OpenStream {
public:
  virtual ~OpenStream() = default;
  /// Queues bytes for the client; ignored once the stream has ended.
  virtual void push(std::string bytes) = 0;
  /// Runs `f` once when the stream ends (the client closed, or an error); at once if it has.
  virtual void on_close(std::function<void()> f) = 0;
};

class SessionBase;

/// How a handler answers: exactly one of send(), send_file() or stream(), once, from any
/// thread. The session writes the answer on its own strand.
class Responder {
public:
  explicit Responder(std::shared_ptr<SessionBase> s) : m_session(std::move(s)) {}
  void send(Response&& res) const;
  void send_file(FileResponse&& res) const;
  /// Writes a 200 head with `content_type` and `Connection: close`, then what is pushed.
  std::shared_ptr<OpenStream> stream(std::string_view content_type) const;
  /// The connection's socket, for poll(2) only (a handler that answers late watches it with
  /// POLLRDHUP to learn that the client went away); never read from, written to or closed.
  /// It stays open until the answer is sent, since the session reads nothing meanwhile.
  int native_handle() const;

private:
  std::shared_ptr<SessionBase> m_session;
};

/// The service behind an edge. Implementations are thread-safe.
class Handler {
public:
  virtual ~Handler() = default;
  /// A problem when this peer may not be served at all (the connection gets it and closes).
  virtual std::optional<Problem> admit(const Peer&) { return std::nullopt; }
  /// The body the request with this header may carry (called on an I/O thread).
  virtual BodyPlan plan(const RequestHeader& header, const Peer& peer) = 0;
  /// Answers a whole request. A HEAD request reaches the handler as HEAD; the edge sends
  /// only the head of whatever it answers.
  virtual void handle(Request&& req, const Peer& peer, std::shared_ptr<BodySink> sink, Responder responder) = 0;
};

/// Settings of one edge.
struct EdgeOptions {
  std::string server_name = "mep";             ///< the Server header
  std::chrono::seconds io_timeout{30};         ///< a whole request (or an idle keep-alive wait)
  std::chrono::seconds handshake_timeout{10};  ///< TLS
  std::chrono::seconds linger_time{5};         ///< draining a refused body, at most
  std::size_t linger_bytes = 64 * 1024 * 1024; ///< and at most this much
  std::size_t header_limit = k_header_limit;
  /// Unix sockets: connections one user may hold at once (0: no limit); its next one is
  /// marked Peer::over_limit. Users in uncapped_uids are not counted.
  std::size_t connections_per_uid = 0;
  std::vector<uid_t> uncapped_uids = {};
};

/// A problem response (application/problem+json) with a fresh request id as its instance
/// and X-Request-Id.
Response problem_response(Problem p, unsigned version, bool keep_alive, std::string_view server_name);

/// "16 KiB", "1 GiB", "1000 bytes": a limit as the 413 detail says it.
std::string format_size(std::size_t bytes);

/// When the next accept is started. After a failed one (out of file descriptors, most
/// often; the failure repeats at once while it lasts) the next waits 5 ms, doubling up to
/// 1 s, as Go's net/http does, and the run of failures is logged once, not per attempt.
class AcceptPacing {
public:
  /// `executor`: the acceptor's (a strand, where several threads run the io_context).
  explicit AcceptPacing(const boost::asio::any_io_executor& executor) : m_timer(executor) {}
  /// Runs `next` at once after an accept that succeeded, later after one that failed.
  void then(const boost::system::error_code& ec, std::function<void()> next);
  /// Drops a pending `next` (the listener is stopping).
  void cancel() { m_timer.cancel(); }
  /// The wait before the next accept (0 after a success).
  std::chrono::milliseconds delay() const { return m_delay; }

private:
  boost::asio::steady_timer m_timer;
  std::chrono::milliseconds m_delay{0};
  std::uint64_t m_failures = 0;
};

/// Accepts TCP connections (TLS when given a context) and runs sessions until stopped.
class TcpListener {
public:
  /// Binds `endpoint` (port 0 picks a free one). Throws boost::system::system_error.
  TcpListener(boost::asio::io_context& ioc, boost::asio::ip::tcp::endpoint endpoint, Handler& handler,
              boost::asio::ssl::context* tls, EdgeOptions options);
  boost::asio::ip::tcp::endpoint local_endpoint() const;
  void start();
  /// Stops accepting; sessions in flight finish their request.
  void stop_accepting();
  /// Requests read and not yet answered.
  int in_flight() const { return m_in_flight->load(); }

private:
  void do_accept();
  boost::asio::io_context& m_ioc;
  boost::asio::ip::tcp::acceptor m_acceptor;
  Handler& m_handler;
  boost::asio::ssl::context* m_tls;
  EdgeOptions m_options;
  std::shared_ptr<std::atomic<int>> m_in_flight = std::make_shared<std::atomic<int>>(0);
  AcceptPacing m_pacing{m_acceptor.get_executor()};
};

/// Accepts connections on a bound, listening Unix-socket acceptor.
class UnixListener {
public:
  UnixListener(boost::asio::io_context& ioc, boost::asio::local::stream_protocol::acceptor acceptor, Handler& handler,
               EdgeOptions options);
  void start();
  void stop_accepting();
  int in_flight() const { return m_in_flight->load(); }

private:
  void do_accept();
  /// Counts `peer`'s connection against its user's limit (EdgeOptions::connections_per_uid);
  /// false: close it at once (refusals enough already in flight).
  bool count_connection(Peer& peer);
  boost::asio::io_context& m_ioc;
  boost::asio::local::stream_protocol::acceptor m_acceptor;
  Handler& m_handler;
  EdgeOptions m_options;
  std::shared_ptr<std::atomic<int>> m_in_flight = std::make_shared<std::atomic<int>>(0);
  AcceptPacing m_pacing{m_acceptor.get_executor()};
  struct UidCounts;
  std::shared_ptr<UidCounts> m_uid_counts;
};

/// HOST:PORT ([v6]:PORT too; "localhost" is 127.0.0.1) as an endpoint; nullopt when it is not one.
std::optional<boost::asio::ip::tcp::endpoint> parse_listen(const std::string& listen);

/// Raises the soft limit on open files to the hard one (as Go programs such as etcd do at
/// start): a server holds a descriptor per connection, and a waiting claim keeps its
/// connection open, so the common default of 1024 would end accepting long before the
/// server's own bounds. Returns the soft limit in force afterwards.
std::uint64_t raise_open_files_limit();

/// Runs `ioc` on the calling thread until it is stopped; an exception that escapes a
/// handler is logged and the thread goes on running (the exception boundary of I/O threads).
void run_io_thread(boost::asio::io_context& ioc);

/// A TLS 1.3-only server context from PEM files; throws std::runtime_error with a readable message.
std::unique_ptr<boost::asio::ssl::context> make_tls_context(const std::string& cert_file, const std::string& key_file);

// ---- routing --------------------------------------------------------------------------------

/// The path of a request target split into decoded segments, and its query; nullopt when
/// the target is not a valid origin-form.
struct Target {
  std::vector<std::string> segments;
  std::vector<std::pair<std::string, std::string>> query;
};
std::optional<Target> parse_target(std::string_view target);

/// True when `pattern` ("/v1/objects/{id}") matches `segments`; `params` gets the values of
/// the {…} segments in order.
bool match_pattern(std::string_view pattern, const std::vector<std::string>& segments,
                   std::vector<std::string>& params);

/// Why a request's body may not be read as JSON: a Content-Type other than application/json
/// in UTF-8, or a Content-Encoding (415), or two Content-Types (400). nullopt when it may.
std::optional<Problem> json_body_problem(const boost::beast::http::fields& headers);

/// Whether an Authorization header value is a Bearer credential (the scheme in any case,
/// RFC 9110 §11.1): the token, trimmed, or nullopt.
std::optional<std::string_view> bearer_token(std::string_view authorization);

/// A route's method as the Allow header of a 405 names it: GET routes answer HEAD too.
std::string allow_entry(Verb v);

/// Finds the row of `rows` (each with `.method` and `.pattern`) that matches; when none
/// does, `allow` lists the methods the path accepts (empty: no such path, 404).
template <class Row>
const Row* find_route(const std::vector<Row>& rows, Verb method, const std::vector<std::string>& segments,
                      std::vector<std::string>& params, std::string& allow) {
  allow.clear();
  for (const auto& r : rows) {
    std::vector<std::string> found;
    if (!match_pattern(r.pattern, segments, found)) continue;
    if (r.method == method) {
      params = std::move(found);
      return &r;
    }
    if (!allow.empty()) allow += ", ";
    allow += allow_entry(r.method);
  }
  return nullptr;
}

} // namespace mep::http
