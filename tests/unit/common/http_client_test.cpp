// The libcurl client over a Unix socket, as mep uses it to reach mepd: an answer, a stream
// handed over piece by piece and stopped, a wait ended from another thread by shutdown(2),
// and the system's error of a connect that failed. The server is a plain socket in a thread;
// a client that missed its stop would wait for ever, and ctest's bound fails the test.
#include "mep/http/client.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

// One connection at a time: reads a request head, then runs `answer` on the connection.
class UnixServer {
public:
  template <class F>
  explicit UnixServer(F answer) {
    char tmpl[] = "/tmp/mep-http-client-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    m_dir = tmpl;
    path = (m_dir / "s.sock").string();
    m_fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, path.c_str());
    REQUIRE(::bind(m_fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(m_fd, 4) == 0);
    m_thread = std::thread([this, answer] {
      int c;
      while ((c = ::accept(m_fd, nullptr, nullptr)) >= 0) {
        std::string head;
        char buf[1024];
        while (head.find("\r\n\r\n") == std::string::npos) {
          ssize_t n = ::recv(c, buf, sizeof buf, 0);
          if (n <= 0) break;
          head.append(buf, static_cast<std::size_t>(n));
        }
        answer(c, head);
        ::close(c);
      }
    });
  }
  ~UnixServer() {
    ::shutdown(m_fd, SHUT_RDWR);
    m_thread.join();
    ::close(m_fd);
    std::error_code ec;
    fs::remove_all(m_dir, ec);
  }
  std::string path;

private:
  fs::path m_dir;
  int m_fd = -1;
  std::thread m_thread;
};

void send_text(int fd, const std::string& s) { (void)::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

} // namespace

TEST_CASE("http client: a request over a Unix socket gets its answer", "[http]") {
  std::string seen;
  UnixServer server([&](int fd, const std::string& head) {
    seen = head;
    send_text(fd, "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{\"a\":\"b\"}");
  });
  mep::http::Client client;
  mep::http::ClientRequest req;
  req.url = "http://mepd/v1/status?x=1";
  req.unix_socket = server.path;
  auto res = client.perform(req);
  CHECK(res.status == 404);
  CHECK(res.body == "{\"a\":\"b\"}");
  CHECK(seen.rfind("GET /v1/status?x=1 HTTP/1.1\r\n", 0) == 0);
}

TEST_CASE("http client: a stream is handed over as it comes, and stopped by its reader", "[http]") {
  UnixServer server([](int fd, const std::string&) {
    send_text(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n");
    send_text(fd, "5\r\none\nt\r\n");
    std::this_thread::sleep_for(50ms);
    send_text(fd, "3\r\nwo\n\r\n");
    char b;
    while (::recv(fd, &b, 1, 0) > 0) { // never ends on its own: the reader closes it (else ctest's bound)
    }
  });
  mep::http::Client client;
  mep::http::ClientRequest req;
  req.url = "http://mepd/v1/events";
  req.unix_socket = server.path;
  req.timeout = 0ms;
  int head_status = 0;
  std::string got;
  req.on_head = [&](int status) { head_status = status; };
  req.on_data = [&](std::string_view piece) {
    got.append(piece);
    return got.find("two\n") == std::string::npos;
  };
  auto res = client.perform(req);
  CHECK(head_status == 200);
  CHECK(res.status == 200);
  CHECK(got == "one\ntwo\n");
  CHECK(res.body.empty());
}

TEST_CASE("http client: shutdown(2) of the descriptor ends a wait at once", "[http]") {
  std::atomic<bool> done{false};
  UnixServer server([&](int, const std::string&) {
    while (!done) std::this_thread::sleep_for(10ms); // a waiting attach: no answer until perform returned
  });
  mep::http::Client client;
  mep::http::ClientRequest req;
  req.method = "POST";
  req.url = "http://mepd/v1/attach";
  req.body = "{}";
  req.unix_socket = server.path;
  req.timeout = 0ms;
  std::atomic<int> fd{-1};
  std::atomic<int> closed{0};
  req.on_socket = [&](int s) {
    if (s < 0) ++closed;
    fd = s;
  };
  std::thread canceller([&] {
    while (fd < 0) std::this_thread::sleep_for(5ms);
    std::this_thread::sleep_for(100ms);
    ::shutdown(fd, SHUT_RDWR);
  });
  auto res = client.perform(req); // without the shutdown, it would wait until ctest's bound
  canceller.join();
  done = true;
  CHECK(res.status == 0);
  CHECK(closed == 1); // told before the descriptor was closed
  CHECK(fd == -1);
}

TEST_CASE("http client: a socket that is not there fails with the system's error", "[http]") {
  mep::http::Client client;
  mep::http::ClientRequest req;
  req.url = "http://mepd/v1/status";
  req.unix_socket = "/nonexistent/mep/mepd.sock";
  auto res = client.perform(req);
  CHECK(res.status == 0);
  CHECK(res.os_errno == ENOENT);
  CHECK_FALSE(res.timed_out);
}
