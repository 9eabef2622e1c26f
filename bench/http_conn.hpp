// A minimal blocking HTTP/1.1 client with keep-alive for the benchmarks: one connection
// (TCP on loopback or a Unix socket), whole requests out, Content-Length responses in.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

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

  /// Sends `method target` with a JSON body and `extra_headers` (each ending in \r\n) and
  /// returns {status, body}. Throws std::runtime_error when the connection fails.
  std::pair<int, std::string> request(const std::string& method, const std::string& target, const std::string& body,
                                      const std::string& extra_headers = {}) {
    std::string req = method + " " + target + " HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n" +
                      "Content-Length: " + std::to_string(body.size()) + "\r\n" + extra_headers + "\r\n" + body;
    for (std::size_t off = 0; off < req.size();) {
      ssize_t n = ::send(m_fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send");
      off += static_cast<std::size_t>(n);
    }
    std::size_t head;
    while ((head = m_buf.find("\r\n\r\n")) == std::string::npos) fill();
    int status = std::atoi(m_buf.c_str() + 9);
    std::size_t len = 0;
    auto cl = m_buf.find("Content-Length: ");
    if (cl != std::string::npos && cl < head) len = std::strtoul(m_buf.c_str() + cl + 16, nullptr, 10);
    while (m_buf.size() < head + 4 + len) fill();
    std::string out = m_buf.substr(head + 4, len);
    m_buf.erase(0, head + 4 + len);
    return {status, out};
  }

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
