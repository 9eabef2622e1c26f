// The daemon's socket server: Beast HTTP/1.1 sessions over a local stream socket, peers
// checked with SO_PEERCRED; the requests go to the DaemonHandler (daemon_handler.cpp).
#include "mep/local_server.hpp"

#include "mep/daemon_handler.hpp"
#include "mep/http/edge.hpp"
#include "mep/log.hpp"

#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <grp.h>
#include <linux/capability.h>
#include <memory>
#include <pwd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

namespace mep::daemon {
namespace net = boost::asio;
namespace beast = boost::beast;
using local = net::local::stream_protocol;
namespace fs = std::filesystem;

namespace {

constexpr auto k_io_timeout = std::chrono::seconds(60);
constexpr const char* k_system_group = "mep";

// A system daemon started as root keeps CAP_SETUID and CAP_SETGID only, as the packaged
// one (mepd.service) has them: a file-system uid switched to a user's drops the file
// capabilities, but not CAP_SYS_RESOURCE (a user's fetch would fill the blocks reserved for
// root, past quotas) nor CAP_SYS_PTRACE (a user's path through /proc/PID/cwd/.. would reach
// another user's working directory). Called on the thread that starts the others, before
// them: capabilities are per thread, and inherited.
void keep_only_setid_capabilities() {
  if (::geteuid() != 0) return; // an unprivileged daemon holds what its unit gave it
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3]{};
  for (int cap : {CAP_SETUID, CAP_SETGID}) {
    data[cap / 32].effective |= 1u << (cap % 32);
    data[cap / 32].permitted |= 1u << (cap % 32);
  }
  if (::syscall(SYS_capset, &header, data) != 0)
    throw std::runtime_error(
        fmt::format("--system: cannot give up the capabilities it does not need: {}", std::strerror(errno)));
}

// How many connections one member of the group may hold at once: a quarter of the daemon's
// descriptors, at least 8 and at most 1024 (a member's event streams hold memory too).
std::size_t connections_per_member() {
  rlimit lim{};
  const std::uint64_t files = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 ? lim.rlim_cur : 1024;
  return static_cast<std::size_t>(std::clamp<std::uint64_t>(files / 4, 8, 1024));
}

} // namespace

LocalServer::LocalServer(net::io_context& ioc, DaemonService& service, const fs::path& socket_path, int inherited_fd,
                         bool system)
    : m_ioc(ioc), m_path(socket_path), m_system(system) {
  local::acceptor acceptor(net::make_strand(ioc));
  if (inherited_fd >= 0)
    acceptor.assign(local(), inherited_fd);
  else
    bind_socket(acceptor);
  if (m_system) keep_only_setid_capabilities(); // before the workers start
  m_handler = std::make_unique<DaemonHandler>(service, [this](const http::Peer& p) { return peer_allowed(p); });
  http::EdgeOptions options;
  options.server_name = "mepd";
  options.io_timeout = k_io_timeout;
  if (m_system) {
    // One member must not take the descriptors (and the memory of event streams) that the
    // others need: each holds a quarter of the daemon's descriptors at most, and 1024.
    options.connections_per_uid = connections_per_member();
    options.uncapped_uids = {::getuid(), 0};
    // And half of them, 256 at most, as attaches waiting for a name (a thread each).
    m_handler->limit_waiting_per_member(
        static_cast<int>(std::clamp<std::size_t>(options.connections_per_uid / 2, 1, 256)));
  }
  m_listener = std::make_unique<http::UnixListener>(ioc, std::move(acceptor), *m_handler, options);
}

void LocalServer::bind_socket(local::acceptor& acceptor) {
  const fs::path& socket_path = m_path;
  net::io_context& ioc = m_ioc;
  std::error_code ec;
  fs::path dir = socket_path.parent_path();
  // System mode: the group mep reaches the socket (SPEC §7: directory 0750, socket 0660).
  gid_t sock_gid = static_cast<gid_t>(-1);
  if (m_system) {
    const struct group* g = ::getgrnam(k_system_group);
    if (!g)
      throw std::runtime_error(
          fmt::format("--system serves the members of the group {}, which does not exist (create it "
                      "with systemd-sysusers or groupadd --system {})",
                      k_system_group, k_system_group));
    sock_gid = g->gr_gid;
  }
  if (!dir.empty() && !fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    if (ec) throw std::runtime_error("cannot create " + dir.string() + ": " + ec.message());
    ::chmod(dir.c_str(), m_system ? 0750 : 0700);
    if (m_system && ::chown(dir.c_str(), static_cast<uid_t>(-1), sock_gid) != 0)
      throw std::runtime_error(
          fmt::format("cannot give {} to the group {}: {}", dir.string(), k_system_group, std::strerror(errno)));
  } else if (struct stat st{}; !dir.empty() && ::stat(dir.c_str(), &st) == 0 &&
                               (st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    // Whoever may write there may replace the socket with their own.
    throw std::runtime_error(fmt::format("the socket's directory {} is writable by others (mode {:04o}); make it 0700",
                                         dir.string(), st.st_mode & 07777));
  }
  if (struct stat st{}; ::lstat(socket_path.c_str(), &st) == 0) {
    // Only a socket is ever replaced: anything else at the path is someone's file.
    if (!S_ISSOCK(st.st_mode))
      throw std::runtime_error(fmt::format("{} exists and is not a socket (it is {}); mepd replaces only a socket "
                                           "that a daemon which died left behind",
                                           socket_path.string(),
                                           S_ISDIR(st.st_mode)   ? "a directory"
                                           : S_ISLNK(st.st_mode) ? "a symbolic link"
                                           : S_ISREG(st.st_mode) ? "a file"
                                                                 : "not a socket"));
    // A socket left by a daemon that died: remove it only if nobody answers on it.
    local::socket probe(ioc);
    beast::error_code cec;
    probe.connect(local::endpoint(socket_path.string()), cec);
    if (!cec) throw std::runtime_error("another mepd is already listening on " + socket_path.string());
    fs::remove(socket_path, ec);
  }
  // The socket gets its name only once it accepts connections: it is bound under a name of
  // its own in the same directory, given its mode and group, set listening, and then linked
  // to its name. A client that waits for the path and connects at once is never refused.
  // link(2) fails when the name exists, as bind(2) does: of two daemons starting at once on
  // one path, the second is refused (rename(2) would take the name from the first). Where
  // the staging name would not fit in a socket address, the socket is bound in place.
  // link(2) takes any path, a socket address only one of sun_path's size: a longer path
  // would be named but could not be connected to.
  if (socket_path.native().size() >= sizeof(sockaddr_un::sun_path))
    throw std::runtime_error(fmt::format("the socket path {} is {} bytes long; a Unix socket's may be {} at most",
                                         socket_path.string(), socket_path.native().size(),
                                         sizeof(sockaddr_un::sun_path) - 1));
  const fs::path staging = dir / fmt::format(".mepd-{}.sock", ::getpid());
  const bool staged = staging.native().size() < sizeof(sockaddr_un::sun_path);
  const fs::path& bound = staged ? staging : socket_path;
  if (staged) fs::remove(staging, ec); // left by a daemon that died with this pid
  struct Unlink {
    const fs::path* path;
    ~Unlink() {
      std::error_code e;
      if (path) fs::remove(*path, e);
    }
  } cleanup{staged ? &staging : nullptr};
  mode_t old = ::umask(077);
  beast::error_code bec;
  acceptor.open(local(), bec);
  if (!bec) acceptor.bind(local::endpoint(bound.string()), bec);
  ::umask(old);
  if (bec) throw std::runtime_error("cannot bind " + bound.string() + ": " + bec.message());
  ::chmod(bound.c_str(), m_system ? 0660 : 0600);
  if (m_system && ::chown(bound.c_str(), static_cast<uid_t>(-1), sock_gid) != 0)
    throw std::runtime_error(
        fmt::format("cannot give {} to the group {}: {}", bound.string(), k_system_group, std::strerror(errno)));
  acceptor.listen(net::socket_base::max_listen_connections, bec);
  if (bec) throw std::runtime_error("cannot listen on " + bound.string() + ": " + bec.message());
  if (staged && ::link(staging.c_str(), socket_path.c_str()) != 0) {
    if (errno == EEXIST) throw std::runtime_error("another mepd is already listening on " + socket_path.string());
    // A file system without hard links: the name is taken over instead.
    if (::rename(staging.c_str(), socket_path.c_str()) != 0)
      throw std::runtime_error("cannot name the socket " + socket_path.string() + ": " + std::strerror(errno));
  }
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

// SPEC §7: the daemon's own user; in system mode also root and the members of the socket's
// group (mep), each of whom then sees only its own leases (Keeper, may_act_on).
bool LocalServer::peer_allowed(const http::Peer& peer) const {
  const uid_t uid = peer.uid;
  const gid_t gid = peer.gid;
  if (uid == ::getuid()) return true;
  if (!m_system) return false;
  if (uid == 0) return true;
  struct stat st {};
  std::string path = m_path.string();
  if (path.empty() || ::stat(path.c_str(), &st) != 0 || !(st.st_mode & S_IWGRP)) return false;
  if (gid == st.st_gid) return true;
  // The groups it connected with: no lookup of the user (which fails, and refused members
  // as strangers, when the daemon is out of descriptors).
  if (peer.groups) return std::find(peer.groups->begin(), peer.groups->end(), st.st_gid) != peer.groups->end();
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
