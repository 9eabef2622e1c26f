// The CLI's client for mepd's socket (libcurl): one HTTP/1.1 request per call, and the
// NDJSON event stream for `mep run`.
#pragma once
#include "mep/daemon_api/types.hpp"
#include "mep/problem.hpp"

#include <CLI/App.hpp>
#include <boost/json/object.hpp>

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace mep::cli {

/// A file path as mepd is to take it: absolute (from this process's directory) but not
/// normalized, since ".." after a symbolic link is for the kernel (mepd) to resolve, not
/// text to drop. Throws UsageError for a path that is not UTF-8 (it travels as JSON text).
std::string path_argument(const std::string& path);

/// The socket path: --socket, else MEP_SOCKET / config `socket`, else
/// $XDG_RUNTIME_DIR/mep/mepd.sock, else /run/mep/mepd.sock.
std::string resolve_socket(const std::string& flag, const std::string& config_file);

struct DaemonReply {
  int status = 0; ///< 0: the daemon could not be reached
  std::string body;
  std::string error;   ///< why it could not be reached
  bool denied = false; ///< the socket is another user's (EACCES): forbidden, not unavailable

  /// mepd did what was asked (a 2xx answer).
  bool ok() const { return status >= 200 && status < 300; }
  /// The kind of mepd's refusal (held, gone, retry, …); nullopt for a 2xx answer and for no
  /// answer at all (status 0: see problem()). What the commands decide on, not the status.
  std::optional<Kind> refusal() const;
  bool held() const { return refusal() == Kind::held; }
  bool reached() const { return status != 0; }

  boost::json::object json() const;
  /// The problem carried by an error reply (or `unavailable` when unreachable).
  Problem problem(const std::string& socket) const;
};

/// Lets one thread end a request another one is blocked in (a waiting attach): cancel()
/// shuts its connection down, and the request returns as unreachable (status 0). Once
/// cancelled, it stays so: later requests made with it return at once.
class Cancel {
public:
  void cancel();
  bool cancelled() const;
  /// For daemon_request: the connection to shut down, -1 once it is closed; false (and not
  /// kept) when already cancelled.
  bool watch(int fd);

private:
  mutable std::mutex m_mutex;
  int m_fd = -1;
  bool m_cancelled = false;
};

/// One request; blocks until the whole response arrived (or `timeout_ms` passed between
/// two reads; -1: no bound), or `cancel` ended it. Goes to the daemon client in use: mepd's
/// socket, or a test's fake (ScopedDaemonClient).
DaemonReply daemon_request(const std::string& socket, const std::string& method, const std::string& target,
                           const std::string& body = {}, int timeout_ms = 60000, Cancel* cancel = nullptr);
/// The same, to an endpoint of the API's table (daemon_api::target: its method and path).
inline DaemonReply daemon_request(const std::string& socket, const daemon_api::Target& to, const std::string& body = {},
                                  int timeout_ms = 60000, Cancel* cancel = nullptr) {
  return daemon_request(socket, std::string(to.method), to.target, body, timeout_ms, cancel);
}

/// How the commands reach mepd, one request at a time. The default is libcurl over the Unix
/// socket (mep::http::Client); the commands' unit tests put a fake in its place.
class DaemonClient {
public:
  virtual ~DaemonClient() = default;
  virtual DaemonReply request(const std::string& socket, const std::string& method, const std::string& target,
                              const std::string& body, int timeout_ms, Cancel* cancel) = 0;
};

/// Puts `client` in the place of mepd's socket for daemon_request() until it goes out of
/// scope (one at a time; not for the event stream of mep run, which reads the socket).
class ScopedDaemonClient {
public:
  explicit ScopedDaemonClient(DaemonClient& client);
  ~ScopedDaemonClient();
  ScopedDaemonClient(const ScopedDaemonClient&) = delete;
  ScopedDaemonClient& operator=(const ScopedDaemonClient&) = delete;
};

/// A --wait value: seconds (a non-negative number, rounded up), or "inf" (until
/// interrupted: k_wait_forever). nullopt when it is neither.
inline constexpr std::int64_t k_wait_forever = 2147483647;
std::optional<std::int64_t> parse_wait(const std::string& text);

/// POST /v1/attach with `body`, waiting up to `wait_s` for a held name or memory (the
/// wait_seconds field). On a terminal it first asks without waiting and, when the name is
/// held, says so on stderr with the number of claims waiting ahead.
DaemonReply attach(const std::string& socket, daemon_api::AttachBody body, std::int64_t wait_s);

/// Opens GET /v1/events and calls `on_line` for each event line until it returns false
/// or the stream ends. Returns false when the daemon could not be reached. `on_connected`
/// gets the stream's descriptor once it is open, and -1 just before it is closed.
bool follow_events(const std::string& socket, const std::function<bool(const std::string&)>& on_line,
                   const std::function<void(int fd)>& on_connected);

/// What a claim says of its holder (mep claim/run --label, --max-hold): the labels (KEY=VALUE,
/// each key once) and the longest hold. `add_holder_options` adds the flags to `cmd`.
struct HolderOptions {
  std::vector<std::string> labels;
  std::optional<std::int64_t> max_hold_s;
  /// Checks the labels (UsageError) and sets an attach's labels (sorted) and max_hold_s.
  void add_to(daemon_api::AttachBody& attach) const;
};
void add_holder_options(CLI::App* cmd, HolderOptions& o);

/// "held by builder-7 on host-a since 14:02, expires in 21 s" for a refusal that names its
/// holder (the holder member of a 423); empty when it names none.
std::string held_by(const Problem& p);

/// "mepd's answer to WHAT is not the API this mep reads (WHY)": an answer the daemon_api
/// decoders refused (another mepd version, a bug), for one line on stderr or a tool's error.
std::string unreadable_answer(std::string_view what, const Problem& why);

/// Prints a reply the way every command does: the JSON document with --json, else the
/// problem's title and detail on stderr. Returns the exit code of the problem's code.
int report_problem(const DaemonReply& r, const std::string& socket, bool json);

/// For a 2xx reply of POST /v1/detach: the control plane's problem when it did not confirm
/// the release (the lease ended on this host all the same), else nullopt.
std::optional<Problem> unconfirmed_release(const DaemonReply& r);

/// The exit status for a release the control plane did not confirm: 4 (superseded, expired
/// or gone there), 5 (not reached) or 7 (the daemon's token refused).
int unconfirmed_release_status(const Problem& p);

/// Says on stderr that `name` was released on this host only, and why.
void warn_unconfirmed_release(const std::string& name, const Problem& p);

} // namespace mep::cli
