// The daemon's socket server. Sessions are Beast HTTP/1.1 over local stream sockets;
// the route table is small and lives here (decode JSON → Keeper → encode).
#include "mep/local_server.hpp"

#include "mep/expect_continue.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/router.hpp"
#include "mep/uuid.hpp"
#include "mep/wire.hpp"

#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/url/parse.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <deque>
#include <fstream>
#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::daemon {
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using local = net::local::stream_protocol;
using json::Need;
namespace fs = std::filesystem;

namespace {

constexpr auto k_io_timeout = std::chrono::seconds(60);

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// Resolves a path given by a local client: relative paths are taken from the client's
// working directory, so `curl` and the CLI behave like any other local tool.
fs::path client_path(const std::string& p, pid_t pid) {
  fs::path path(p);
  if (path.is_relative() && pid > 0) {
    std::error_code ec;
    auto cwd = fs::read_symlink("/proc/" + std::to_string(pid) + "/cwd", ec);
    if (!ec) path = cwd / path;
  }
  return path.lexically_normal();
}

// The mode a file the client creates itself would get: 0666 less the client's umask, as
// Linux (4.7 and later) reports it in /proc/PID/status; 0600 when it cannot be read. A
// memory file mepd creates for `mep init` is then no more open than the user asked for.
mode_t client_file_mode(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Umask:", 0) != 0) continue;
    const unsigned long mask = std::strtoul(line.c_str() + 6, nullptr, 8);
    return static_cast<mode_t>(0666 & ~mask);
  }
  return 0600;
}

class Session : public std::enable_shared_from_this<Session> {
public:
  Session(local::socket&& s, Keeper& k, PeerCred peer) : m_stream(std::move(s)), m_keeper(k), m_peer(peer) {}
  ~Session() {
    if (m_sink_id) m_keeper.unsubscribe(m_sink_id);
  }

  void run() {
    net::dispatch(m_stream.get_executor(), [self = shared_from_this()] { self->do_read(); });
  }

  void reject() { refuse(Problem(Code::forbidden, "peer is not allowed to use this daemon")); }

  // Answers a request that is not served with `p`, then closes the connection.
  void refuse(const Problem& p) {
    std::string rid = uuid_v7().to_string();
    m_close = true;
    write(response(server::problem_reply(p, rid), 11, false, rid));
  }

private:
  void do_read() {
    m_parser.emplace();
    m_parser->body_limit(server::k_body_limit);
    m_parser->header_limit(server::k_header_limit);
    m_stream.expires_after(k_io_timeout);
    m_continue_sent = false;
    read_some();
  }

  // Reads until the request is whole; a client that sent `Expect: 100-continue` gets the
  // 100 once its header is read and accepted (RFC 9110 10.1.1), as from mep server.
  void read_some() {
    http::async_read_some(m_stream, m_buffer, *m_parser,
                          beast::bind_front_handler(&Session::on_read_some, shared_from_this()));
  }

  void on_read_some(beast::error_code ec, std::size_t n) {
    if (ec || m_parser->is_done()) return on_read(ec, n);
    if (server::owes_continue(*m_parser, m_continue_sent)) {
      return net::async_write(m_stream, server::continue_response(),
                              [self = shared_from_this()](beast::error_code e, std::size_t) {
                                if (e) return self->on_read(e, 0);
                                self->read_some();
                              });
    }
    read_some();
  }

  static server::HttpResponse response(const server::Reply& r, unsigned version, bool keep_alive,
                                       const std::string& rid = {}) {
    server::HttpResponse res{static_cast<http::status>(r.status), version};
    res.set(http::field::server, "mepd");
    if (!rid.empty()) res.set("X-Request-Id", rid);
    if (!r.body.empty() || r.status != 204) {
      res.set(http::field::content_type, r.problem ? "application/problem+json" : "application/json");
      res.body() = r.body;
    }
    if (r.retry_after_s) res.set(http::field::retry_after, std::to_string(*r.retry_after_s));
    if (!r.allow.empty()) res.set(http::field::allow, r.allow);
    res.keep_alive(keep_alive);
    res.prepare_payload();
    return res;
  }

  void on_read(beast::error_code ec, std::size_t) {
    if (ec) {
      if (ec == http::error::body_limit || ec == http::error::header_limit)
        return refuse(Problem(Code::payload_too_large, "request too large"));
      if (ec.category() == beast::error_code(http::error::bad_target).category() && ec != http::error::end_of_stream &&
          ec != http::error::partial_message)
        return refuse(Problem(Code::invalid_request, "malformed HTTP request"));
      beast::error_code ignored;
      m_stream.socket().shutdown(local::socket::shutdown_send, ignored);
      return;
    }
    if (const char* why = server::framing_problem(m_parser->get())) return refuse(Problem(Code::invalid_request, why));
    server::HttpRequest req = m_parser->release();
    if (req.method() == http::verb::get && req.target() == "/v1/events") return start_events(req);
    // Keeper calls may block on the control plane: run them off the I/O threads' strand
    // order but on the pool, then post the answer back.
    auto self = shared_from_this();
    net::post(m_stream.get_executor(), [self, req = std::move(req)]() mutable {
      std::string rid = uuid_v7().to_string();
      server::Reply r = self->route(req, rid);
      self->m_close = !req.keep_alive();
      server::HttpResponse res = response(r, req.version(), req.keep_alive(), rid);
      if (req.method() == http::verb::head) res.body().clear(); // GET's headers, no content
      self->write(std::move(res));
    });
  }

  void write(server::HttpResponse&& res) {
    m_response = std::move(res);
    m_stream.expires_after(k_io_timeout);
    http::async_write(m_stream, m_response, beast::bind_front_handler(&Session::on_write, shared_from_this()));
  }

  void on_write(beast::error_code ec, std::size_t) {
    if (ec || m_close) {
      beast::error_code ignored;
      m_stream.socket().shutdown(local::socket::shutdown_send, ignored);
      return;
    }
    do_read();
  }

  // ---- the event stream: headers, then one JSON line per event until the client goes ----
  void start_events(const server::HttpRequest& req) {
    m_stream.expires_never();
    std::string head = "HTTP/1.1 200 OK\r\nServer: mepd\r\nContent-Type: application/x-ndjson\r\n"
                       "Cache-Control: no-store\r\nConnection: close\r\n\r\n";
    (void)req;
    std::weak_ptr<Session> weak = shared_from_this();
    auto exec = m_stream.get_executor();
    m_sink_id = m_keeper.subscribe([weak, exec](const std::string& line) {
      net::post(exec, [weak, line] {
        if (auto s = weak.lock()) s->queue_line(line);
      });
    });
    queue_line(head);
    // Notice the client closing: a read that completes (EOF) ends the stream.
    m_stream.socket().async_wait(local::socket::wait_error,
                                 [self = shared_from_this()](beast::error_code) { self->end_events(); });
  }

  void queue_line(const std::string& line) {
    if (m_events_done) return;
    m_lines.push_back(line);
    if (m_lines.size() == 1) write_line();
  }

  void write_line() {
    net::async_write(m_stream.socket(), net::buffer(m_lines.front()),
                     [self = shared_from_this()](beast::error_code ec, std::size_t) {
                       if (ec) return self->end_events();
                       self->m_lines.pop_front();
                       if (!self->m_lines.empty()) self->write_line();
                     });
  }

  void end_events() {
    if (m_events_done) return;
    m_events_done = true;
    if (m_sink_id) m_keeper.unsubscribe(m_sink_id);
    m_sink_id = 0;
    beast::error_code ignored;
    m_stream.socket().close(ignored);
  }

  // ---- routes ----
  server::Reply route(const server::HttpRequest& req, const std::string& rid) {
    auto target = boost::urls::parse_origin_form(req.target());
    if (!target) return server::problem_reply(Problem(Code::invalid_request, "malformed target"), rid);
    std::string path(target->path());
    // HEAD is GET without the content (RFC 9110 9.3.2); the caller drops the content.
    auto method = req.method() == http::verb::head ? http::verb::get : req.method();
    http::verb accepted = http::verb::unknown; // the method of the path last checked
    auto need = [&](http::verb v) {
      accepted = v;
      return method == v;
    };
    auto not_allowed = [&] { // RFC 9110 15.5.6: a 405 names what the path accepts
      auto r = server::problem_reply(Problem(Code::method_not_allowed, "this endpoint does not accept that method"), rid);
      r.allow = path == "/v1/events" ? "GET" : server::allow_entry(accepted); // the stream has no HEAD
      return r;
    };
    auto body = [&]() -> expected<boost::json::object, Problem> {
      if (req.body().empty()) return boost::json::object{};
      return json::parse_object(req.body());
    };
    if (path == "/v1/events") { // a plain GET became the stream before routing
      if (need(http::verb::get) && req.method() != http::verb::head)
        return server::problem_reply(Problem(Code::invalid_request, "GET /v1/events takes no query"), rid);
      return not_allowed();
    }
    if (path == "/healthz") return need(http::verb::get) ? server::json_reply(200, m_keeper.health()) : not_allowed();
    if (path == "/metrics") {
      if (!need(http::verb::get)) return not_allowed();
      server::Reply r;
      r.status = 200;
      r.body = m_keeper.metrics();
      return r;
    }
    if (path == "/v1/attach") {
      if (!need(http::verb::post)) return not_allowed();
      auto o = body();
      if (!o) return server::problem_reply(o.error(), rid);
      json::ObjectReader rd(*o);
      AttachRequest a;
      auto name = rd.string("name", Need::required);
      auto p = rd.string("path", Need::required);
      auto ttl = rd.integer("ttl_seconds", Need::optional, -(1LL << 40), 1LL << 40);
      auto bind = rd.string("bind", Need::optional);
      if (bind && *bind != "pid" && *bind != "none") rd.fail("field \"bind\" must be \"pid\" or \"none\"");
      if (auto ok = rd.finish(); !ok) return server::problem_reply(ok.error(), rid);
      a.name = *name;
      a.path = client_path(*p, m_peer.pid);
      a.ttl_s = ttl.value_or(server::k_default_ttl_s);
      a.bind_pid = !bind || *bind == "pid";
      a.pid = m_peer.pid;
      return m_keeper.attach(a, rid);
    }
    if (path == "/v1/detach") {
      if (!need(http::verb::post)) return not_allowed();
      auto o = body();
      if (!o) return server::problem_reply(o.error(), rid);
      json::ObjectReader rd(*o);
      auto name = rd.string("name", Need::required);
      if (auto ok = rd.finish(); !ok) return server::problem_reply(ok.error(), rid);
      return m_keeper.detach(*name, rid);
    }
    if (path == "/v1/leases") return need(http::verb::get) ? m_keeper.list(rid) : not_allowed();
    if (path.rfind("/v1/leases/", 0) == 0 && path.size() > 11) {
      if (!need(http::verb::get)) return not_allowed();
      std::string name;
      for (auto seg : target->segments()) name = std::string(seg);
      return m_keeper.get(name, rid);
    }
    if (path == "/v1/branch" || path == "/v1/init") {
      if (!need(http::verb::post)) return not_allowed();
      auto o = body();
      if (!o) return server::problem_reply(o.error(), rid);
      json::ObjectReader rd(*o);
      auto p = rd.string("path", Need::required);
      std::optional<std::string> np;
      if (path == "/v1/branch") np = rd.string("new_path", Need::required);
      if (auto ok = rd.finish(); !ok) return server::problem_reply(ok.error(), rid);
      if (path == "/v1/init") return m_keeper.init(client_path(*p, m_peer.pid), client_file_mode(m_peer.pid), rid);
      return m_keeper.branch(client_path(*p, m_peer.pid), client_path(*np, m_peer.pid), rid);
    }
    if (path == "/v1/lineage") {
      if (!need(http::verb::get)) return not_allowed();
      std::optional<std::string> p, id;
      for (auto q : target->params()) {
        if (q.key == "path") p = std::string(q.value);
        if (q.key == "id") id = std::string(q.value);
      }
      if (!p && !id) return server::problem_reply(Problem(Code::invalid_request, "query parameter path or id is required"), rid);
      return m_keeper.lineage(p ? std::optional<fs::path>(client_path(*p, m_peer.pid)) : std::nullopt, id.value_or(""), rid);
    }
    if (path == "/v1/identify") {
      if (!need(http::verb::get)) return not_allowed();
      std::optional<std::string> p;
      for (auto q : target->params())
        if (q.key == "path") p = std::string(q.value);
      if (!p || p->empty()) return server::problem_reply(Problem(Code::invalid_request, "query parameter path is required"), rid);
      return m_keeper.identify(client_path(*p, m_peer.pid), rid);
    }
    return server::problem_reply(Problem(Code::not_found, "no such endpoint"), rid);
  }

  beast::basic_stream<local> m_stream;
  Keeper& m_keeper;
  PeerCred m_peer;
  beast::flat_buffer m_buffer;
  std::optional<http::request_parser<http::string_body>> m_parser;
  bool m_continue_sent = false;
  server::HttpResponse m_response;
  bool m_close = false;
  int m_sink_id = 0;
  bool m_events_done = false;
  std::deque<std::string> m_lines;
};

} // namespace

LocalServer::LocalServer(net::io_context& ioc, Keeper& keeper, const fs::path& socket_path, int inherited_fd)
    : m_ioc(ioc), m_keeper(keeper), m_path(socket_path), m_acceptor(net::make_strand(ioc)) {
  if (inherited_fd >= 0) {
    m_acceptor.assign(local(), inherited_fd);
    return;
  }
  std::error_code ec;
  fs::path dir = socket_path.parent_path();
  if (!dir.empty() && !fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) throw std::runtime_error("cannot create " + dir.string() + ": " + ec.message());
    ::chmod(dir.c_str(), 0700);
  } else if (struct stat st {}; !dir.empty() && ::stat(dir.c_str(), &st) == 0 &&
             (st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    // Whoever may write there may replace the socket with their own.
    throw std::runtime_error(fmt::format("the socket's directory {} is writable by others (mode {:04o}); make it 0700",
                                         dir.string(), st.st_mode & 07777));
  }
  if (fs::exists(socket_path, ec)) {
    // A socket left by a daemon that died: remove it only if nobody answers on it.
    local::socket probe(ioc);
    beast::error_code cec;
    probe.connect(local::endpoint(socket_path.string()), cec);
    if (!cec) throw std::runtime_error("another mepd is already listening on " + socket_path.string());
    fs::remove(socket_path, ec);
  }
  mode_t old = ::umask(077);
  beast::error_code bec;
  m_acceptor.open(local(), bec);
  if (!bec) m_acceptor.bind(local::endpoint(socket_path.string()), bec);
  ::umask(old);
  if (bec) throw std::runtime_error("cannot bind " + socket_path.string() + ": " + bec.message());
  ::chmod(socket_path.c_str(), 0600);
  m_acceptor.listen(net::socket_base::max_listen_connections, bec);
  if (bec) throw std::runtime_error("cannot listen on " + socket_path.string() + ": " + bec.message());
  m_owns_path = true;
}

LocalServer::~LocalServer() {
  if (m_owns_path) {
    std::error_code ec;
    fs::remove(m_path, ec);
  }
}

void LocalServer::start() { do_accept(); }

void LocalServer::stop() {
  net::post(m_acceptor.get_executor(), [this] {
    beast::error_code ec;
    m_acceptor.close(ec);
  });
}

// SPEC §7: the daemon's own user; in system mode (a socket the group may use, 0660) also
// members of the socket's group.
bool LocalServer::peer_allowed(const PeerCredView& peer) const {
  if (peer.uid == ::getuid()) return true;
  struct stat st {};
  std::string path = m_path.string();
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || !(st.st_mode & S_IWGRP)) return false;
  if (peer.gid == st.st_gid) return true;
  passwd pw{};
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwuid_r(peer.uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return false;
  int n = 64;
  std::vector<gid_t> groups(static_cast<std::size_t>(n));
  if (::getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n) < 0) {
    groups.resize(static_cast<std::size_t>(n));
    if (::getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n) < 0) return false;
  }
  for (int i = 0; i < n; ++i)
    if (groups[static_cast<std::size_t>(i)] == st.st_gid) return true;
  return false;
}

void LocalServer::do_accept() {
  m_acceptor.async_accept(net::make_strand(m_ioc), [this](beast::error_code ec, local::socket socket) {
    if (ec == net::error::operation_aborted || !m_acceptor.is_open()) return;
    if (!ec) {
      ucred cred{};
      socklen_t len = sizeof cred;
      PeerCred peer;
      bool known = ::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
      if (known) peer = PeerCred{cred.pid, cred.uid, cred.gid};
      auto session = std::make_shared<Session>(std::move(socket), m_keeper, peer);
      if (!known || !peer_allowed(PeerCredView{peer.uid, peer.gid})) {
        log::warn("refused a client with uid {}", known ? static_cast<long>(peer.uid) : -1L);
        session->reject();
      } else {
        session->run();
      }
    }
    do_accept();
  });
}

} // namespace mep::daemon
