// A blocking HTTP/1.1 client on libcurl, for mepd (the control plane, the data plane) and
// mep store (the control plane's fence/verify in --strict mode). TLS 1.3 with certificate
// verification; plain http:// only to loopback addresses. Bodies may be streamed from and
// to file descriptors, so an object of any size moves without being held in memory.
#pragma once
#include <chrono>
#include <functional>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mep::http {

struct ClientRequest {
  std::string method = "GET";
  std::string url; ///< absolute: scheme, host, port, path and query
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;                         ///< sent unless upload_fd is given
  int upload_fd = -1;                       ///< stream the body from here (read from its current offset)…
  std::uint64_t upload_size = 0;            ///< …this many bytes
  int download_fd = -1;                     ///< the body of a 2xx answer is written here instead of into `body`
  std::chrono::milliseconds timeout{10000}; ///< the whole exchange; 0: no bound (see stall)
  std::chrono::milliseconds connect_timeout{3000};
  /// Given, the exchange fails when no byte moves for this long (large bodies, with timeout 0).
  std::optional<std::chrono::seconds> stall;
  /// Given, asked about once a second while the exchange runs (more often while bytes
  /// move); true abandons it (status 0, "cancelled"), closing its connection.
  std::function<bool()> cancelled;
  /// Given, the connection goes to this Unix socket instead of the URL's host (which then
  /// only names the server, as in http://mepd/v1/status; its path is sent as written); a new
  /// connection, closed after.
  std::string unix_socket;
  /// Given, called with the connection's descriptor once it exists (before it connects) and
  /// with -1 just before it is closed: another thread may shutdown(2) it to end the exchange
  /// at once (a cancelled wait, a stopped stream). Implies a new connection, closed after.
  std::function<void(int fd)> on_socket;
  /// Given, called once the answer's head has arrived, with its status.
  std::function<void(int status)> on_head;
  /// Given, the body is handed here piece by piece as it arrives instead of kept in `body`
  /// (a stream); returning false ends the exchange, and the status stays the answer's.
  std::function<bool(std::string_view piece)> on_data;
};

struct ClientResponse {
  int status = 0; ///< 0: no HTTP answer at all (refused, timed out); `error` says why
  std::string error;
  std::string body;                                         ///< the body, unless it went to download_fd
  std::vector<std::pair<std::string, std::string>> headers; ///< names in lower case
  std::uint64_t downloaded = 0;                             ///< bytes written to download_fd
  bool timed_out = false;                                   ///< with status 0: a timeout or stall ended it
  int os_errno = 0; ///< with status 0: the system's error of the failed connect, if any (EACCES, ENOENT…)

  bool ok() const { return status >= 200 && status < 300; }
  /// The first header called `name` (lower case), if any.
  std::optional<std::string> header(std::string_view name) const;
  /// Retry-After in seconds, when the answer carries a number there.
  std::optional<int> retry_after() const;
};

/// A pool of libcurl handles (kept connections); thread-safe, one call per thread at a time
/// on each handle.
class Client {
public:
  /// `ca_file`: PEM certificates to trust for https:// instead of the system's (a private
  /// CA); empty: the system's.
  explicit Client(std::string ca_file = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// Never throws for transport failures (status 0); throws std::bad_alloc, and what the
  /// request's own callbacks threw (the exchange is ended first).
  ClientResponse perform(const ClientRequest& req);

private:
  void* acquire();
  void release(void* handle);
  std::mutex m_mutex;
  std::vector<void*> m_pool;
  std::string m_ca_file;
};

/// `path` when it is a readable file holding at least one PEM certificate; else throws
/// std::runtime_error naming `what` (the option).
std::string checked_ca_file(const std::string& path, std::string_view what);

/// `url` without trailing slashes when it is https://…, or http://… to a loopback host
/// (localhost, 127.0.0.0/8, [::1]); else throws std::runtime_error naming `what`.
std::string checked_base_url(std::string url, std::string_view what);

} // namespace mep::http
