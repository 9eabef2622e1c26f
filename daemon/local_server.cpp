// The daemon's socket server. Sessions are Beast HTTP/1.1 over local stream sockets;
// the route table is small and lives here (decode JSON → Keeper → encode).
#include "mep/local_server.hpp"

#include "mep/http/edge.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/router.hpp"
#include "mep/uuid.hpp"
#include "mep/wire.hpp"

#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/url/parse.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::daemon {
namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using local = net::local::stream_protocol;
using json::Need;
namespace fs = std::filesystem;

namespace {

constexpr auto k_io_timeout = std::chrono::seconds(60);

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

} // namespace

// The daemon's side of the HTTP edge: who may connect, the body limit, and the routes.
class DaemonHandler final : public http::Handler {
public:
  DaemonHandler(Keeper& keeper, std::function<bool(const http::Peer&)> allowed)
      : m_keeper(keeper), m_allowed(std::move(allowed)) {}

  std::optional<Problem> admit(const http::Peer& peer) override {
    if (peer.cred_known && m_allowed(peer)) return std::nullopt;
    log::warn("refused a client with uid {}", peer.cred_known ? static_cast<long>(peer.uid) : -1L);
    return Problem(Code::forbidden, "peer is not allowed to use this daemon");
  }

  http::BodyPlan plan(const http::RequestHeader&, const http::Peer&) override {
    http::BodyPlan plan;
    plan.limit = server::k_body_limit;
    return plan;
  }

  void handle(http::Request&& req, const http::Peer& peer, std::shared_ptr<http::BodySink>,
              http::Responder responder) override {
    if (req.method() == bhttp::verb::get && req.target() == "/v1/events") return start_events(responder);
    // Keeper calls may block on the control plane: they run on the worker pool, so the
    // I/O threads keep serving event streams and other clients.
    net::post(m_work, [this, req = std::move(req), peer, responder]() mutable {
      std::string rid = uuid_v7().to_string();
      server::Reply r;
      try {
        r = route(req, peer, rid);
      } catch (const std::exception& e) {
        log::error("request {} {} failed: {}", rid, std::string(req.target()), e.what());
        r = server::problem_reply(Problem(Code::internal, "internal error"), rid);
      }
      responder.send(response(r, req.version(), req.keep_alive(), rid));
    });
  }

  void stop() { m_work.stop(); }
  void join() { m_work.join(); }

private:
  static http::Response response(const server::Reply& r, unsigned version, bool keep_alive, const std::string& rid) {
    http::Response res{static_cast<bhttp::status>(r.status), version};
    res.set(bhttp::field::server, "mepd");
    if (!rid.empty()) res.set("X-Request-Id", rid);
    if (!r.body.empty() || r.status != 204) {
      res.set(bhttp::field::content_type, r.problem ? "application/problem+json" : "application/json");
      res.body() = r.body;
    }
    if (r.retry_after_s) res.set(bhttp::field::retry_after, std::to_string(*r.retry_after_s));
    if (!r.allow.empty()) res.set(bhttp::field::allow, r.allow);
    res.keep_alive(keep_alive);
    res.prepare_payload();
    return res;
  }

  // The event stream: one JSON line per event until the client goes.
  void start_events(const http::Responder& responder) {
    auto stream = responder.stream("application/x-ndjson");
    int id = m_keeper.subscribe([stream](const std::string& line) { stream->push(line); });
    stream->on_close([this, id] { m_keeper.unsubscribe(id); });
  }

  // ---- routes ----
  server::Reply route(const http::Request& req, const http::Peer& m_peer, const std::string& rid) {
    auto target = boost::urls::parse_origin_form(req.target());
    if (!target) return server::problem_reply(Problem(Code::invalid_request, "malformed target"), rid);
    std::string path(target->path());
    // HEAD is GET without the content (RFC 9110 9.3.2); the caller drops the content.
    auto method = req.method() == bhttp::verb::head ? bhttp::verb::get : req.method();
    bhttp::verb accepted = bhttp::verb::unknown; // the method of the path last checked
    auto need = [&](bhttp::verb v) {
      accepted = v;
      return method == v;
    };
    auto not_allowed = [&] { // RFC 9110 15.5.6: a 405 names what the path accepts
      auto r = server::problem_reply(Problem(Code::method_not_allowed, "this endpoint does not accept that method"), rid);
      r.allow = path == "/v1/events" ? "GET" : http::allow_entry(accepted); // the stream has no HEAD
      return r;
    };
    auto body = [&]() -> expected<boost::json::object, Problem> {
      if (req.body().empty()) return boost::json::object{};
      return json::parse_object(req.body());
    };
    if (path == "/v1/events") { // a plain GET became the stream before routing
      if (need(bhttp::verb::get) && req.method() != bhttp::verb::head)
        return server::problem_reply(Problem(Code::invalid_request, "GET /v1/events takes no query"), rid);
      return not_allowed();
    }
    if (path == "/healthz") return need(bhttp::verb::get) ? server::json_reply(200, m_keeper.health()) : not_allowed();
    if (path == "/metrics") {
      if (!need(bhttp::verb::get)) return not_allowed();
      server::Reply r;
      r.status = 200;
      r.body = m_keeper.metrics();
      return r;
    }
    if (path == "/v1/attach") {
      if (!need(bhttp::verb::post)) return not_allowed();
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
      if (!need(bhttp::verb::post)) return not_allowed();
      auto o = body();
      if (!o) return server::problem_reply(o.error(), rid);
      json::ObjectReader rd(*o);
      auto name = rd.string("name", Need::required);
      if (auto ok = rd.finish(); !ok) return server::problem_reply(ok.error(), rid);
      return m_keeper.detach(*name, rid);
    }
    if (path == "/v1/leases") return need(bhttp::verb::get) ? m_keeper.list(rid) : not_allowed();
    if (path.rfind("/v1/leases/", 0) == 0 && path.size() > 11) {
      if (!need(bhttp::verb::get)) return not_allowed();
      std::string name;
      for (auto seg : target->segments()) name = std::string(seg);
      return m_keeper.get(name, rid);
    }
    if (path == "/v1/branch" || path == "/v1/init") {
      if (!need(bhttp::verb::post)) return not_allowed();
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
      if (!need(bhttp::verb::get)) return not_allowed();
      std::optional<std::string> p, id;
      for (auto q : target->params()) {
        if (q.key == "path") p = std::string(q.value);
        if (q.key == "id") id = std::string(q.value);
      }
      if (!p && !id) return server::problem_reply(Problem(Code::invalid_request, "query parameter path or id is required"), rid);
      return m_keeper.lineage(p ? std::optional<fs::path>(client_path(*p, m_peer.pid)) : std::nullopt, id.value_or(""), rid);
    }
    if (path == "/v1/identify") {
      if (!need(bhttp::verb::get)) return not_allowed();
      std::optional<std::string> p;
      for (auto q : target->params())
        if (q.key == "path") p = std::string(q.value);
      if (!p || p->empty()) return server::problem_reply(Problem(Code::invalid_request, "query parameter path is required"), rid);
      return m_keeper.identify(client_path(*p, m_peer.pid), rid);
    }
    return server::problem_reply(Problem(Code::not_found, "no such endpoint"), rid);
  }

  Keeper& m_keeper;
  std::function<bool(const http::Peer&)> m_allowed;
  net::thread_pool m_work{16};
};


LocalServer::LocalServer(net::io_context& ioc, Keeper& keeper, const fs::path& socket_path, int inherited_fd)
    : m_ioc(ioc), m_keeper(keeper), m_path(socket_path) {
  local::acceptor acceptor(net::make_strand(ioc));
  if (inherited_fd >= 0) acceptor.assign(local(), inherited_fd);
  else bind_socket(acceptor);
  m_handler = std::make_unique<DaemonHandler>(keeper, [this](const http::Peer& p) { return peer_allowed(p.uid, p.gid); });
  http::EdgeOptions options;
  options.server_name = "mepd";
  options.io_timeout = k_io_timeout;
  m_listener = std::make_unique<http::UnixListener>(ioc, std::move(acceptor), *m_handler, options);
}

void LocalServer::bind_socket(local::acceptor& acceptor) {
  const fs::path& socket_path = m_path;
  net::io_context& ioc = m_ioc;
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
  acceptor.open(local(), bec);
  if (!bec) acceptor.bind(local::endpoint(socket_path.string()), bec);
  ::umask(old);
  if (bec) throw std::runtime_error("cannot bind " + socket_path.string() + ": " + bec.message());
  ::chmod(socket_path.c_str(), 0600);
  acceptor.listen(net::socket_base::max_listen_connections, bec);
  if (bec) throw std::runtime_error("cannot listen on " + socket_path.string() + ": " + bec.message());
  m_owns_path = true;
}

LocalServer::~LocalServer() {
  m_handler->stop();
  m_handler->join();
  if (m_owns_path) {
    std::error_code ec;
    fs::remove(m_path, ec);
  }
}

void LocalServer::start() { m_listener->start(); }

void LocalServer::stop() { m_listener->stop_accepting(); }

// SPEC §7: the daemon's own user; in system mode (a socket the group may use, 0660) also
// members of the socket's group.
bool LocalServer::peer_allowed(uid_t uid, gid_t gid) const {
  if (uid == ::getuid()) return true;
  struct stat st {};
  std::string path = m_path.string();
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || !(st.st_mode & S_IWGRP)) return false;
  if (gid == st.st_gid) return true;
  passwd pw{};
  passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return false;
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

} // namespace mep::daemon
