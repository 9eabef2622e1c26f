// A minimal HTTP/1.1 client with keep-alive for the benchmarks: one connection (TCP on
// loopback or a Unix socket), whole requests out, Content-Length responses in. Blocking
// (request) or, for an epoll loop, non-blocking (receive_available, take_response).
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace mep::bench {

class HttpConn {
public:
  /// Connects to 127.0.0.1:`port` (TCP_NODELAY). Throws std::runtime_error.
  static HttpConn tcp(int port) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      throw std::runtime_error("connect 127.0.0.1:" + std::to_string(port));
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return HttpConn(fd);
  }

  /// Connects to the Unix socket at `path`. Throws std::runtime_error.
  static HttpConn unix_socket(const std::string& path) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      throw std::runtime_error("connect " + path);
    }
    return HttpConn(fd);
  }

  HttpConn(HttpConn&& o) noexcept : m_fd(std::exchange(o.m_fd, -1)), m_buf(std::move(o.m_buf)) {}
  HttpConn(const HttpConn&) = delete;
  HttpConn& operator=(const HttpConn&) = delete;
  ~HttpConn() {
    if (m_fd >= 0) ::close(m_fd);
  }

  /// The bytes of `method target` with a JSON body and `extra_headers` (each ending in \r\n).
  static std::string format(const std::string& method, const std::string& target, const std::string& body,
                            const std::string& extra_headers = {}) {
    return method + " " + target + " HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n" +
           "Content-Length: " + std::to_string(body.size()) + "\r\n" + extra_headers + "\r\n" + body;
  }

  /// Sends `method target` with a JSON body and `extra_headers` (each ending in \r\n) and
  /// returns {status, body}. Throws std::runtime_error when the connection fails.
  std::pair<int, std::string> request(const std::string& method, const std::string& target, const std::string& body,
                                      const std::string& extra_headers = {}) {
    return request_bytes(format(method, target, body, extra_headers));
  }

  /// Sends the bytes of a whole request and returns {status, body}.
  std::pair<int, std::string> request_bytes(const std::string& req) {
    send_all(req);
    std::pair<int, std::string> out;
    while (!take_response(out)) fill();
    return out;
  }

  /// Writes all of `req` (the socket may be non-blocking: then it waits for room with poll).
  void send_all(const std::string& req) {
    for (std::size_t off = 0; off < req.size();) {
      ssize_t n = ::send(m_fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EAGAIN) {
        pollfd p{m_fd, POLLOUT, 0};
        ::poll(&p, 1, 1000);
        continue;
      }
      if (n <= 0) throw std::runtime_error("send");
      off += static_cast<std::size_t>(n);
    }
  }

  /// Moves one whole response out of what was received, if there is one.
  bool take_response(std::pair<int, std::string>& out) {
    std::size_t head = m_buf.find("\r\n\r\n");
    if (head == std::string::npos) return false;
    std::size_t len = 0;
    auto cl = m_buf.find("Content-Length: ");
    if (cl != std::string::npos && cl < head) len = std::strtoul(m_buf.c_str() + cl + 16, nullptr, 10);
    if (m_buf.size() < head + 4 + len) return false;
    out.first = std::atoi(m_buf.c_str() + 9);
    out.second = m_buf.substr(head + 4, len);
    m_buf.erase(0, head + 4 + len);
    return true;
  }

  /// Appends what the (non-blocking) socket has; false when the connection is closed or failed.
  bool receive_available() {
    char tmp[16384];
    for (;;) {
      ssize_t n = ::recv(m_fd, tmp, sizeof tmp, 0);
      if (n > 0) {
        m_buf.append(tmp, static_cast<std::size_t>(n));
        continue;
      }
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
  }

  int fd() const { return m_fd; }
  void set_nonblocking() { ::fcntl(m_fd, F_SETFL, ::fcntl(m_fd, F_GETFL) | O_NONBLOCK); }

private:
  explicit HttpConn(int fd) : m_fd(fd) {}
  void fill() {
    char tmp[16384];
    ssize_t n = ::recv(m_fd, tmp, sizeof tmp, 0);
    if (n <= 0) throw std::runtime_error("recv");
    m_buf.append(tmp, static_cast<std::size_t>(n));
  }

  int m_fd;
  std::string m_buf;
};

} // namespace mep::bench
