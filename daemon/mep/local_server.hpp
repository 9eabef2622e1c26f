// mepd's HTTP/1.1 server on a Unix socket (SPEC §7): peers checked with SO_PEERCRED,
// requests routed to the DaemonService (daemon_handler.hpp), the NDJSON event stream on GET /v1/events.
#pragma once
#include "mep/http/edge.hpp"
#include "mep/daemon_service.hpp"

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>

#include <filesystem>
#include <memory>
#include <sys/types.h>

namespace mep::daemon {

class DaemonHandler;

class LocalServer {
public:
  /// Listens on `socket_path` (the directory is created 0700, the socket is 0600), or on
  /// the socket systemd handed over (`inherited_fd` ≥ 0). In system mode (`mepd --system`)
  /// the directory is 0750 and the socket 0660, both of the group `mep`, whose members are
  /// served besides root and the daemon's own user. `service` must outlive `ioc` (an
  /// event stream open at shutdown unsubscribes when `ioc` is destroyed). Throws
  /// std::runtime_error.
  LocalServer(boost::asio::io_context& ioc, DaemonService& service, const std::filesystem::path& socket_path,
              int inherited_fd, bool system = false);
  ~LocalServer();
  void start();
  /// Stops accepting connections.
  void stop();

private:
  void bind_socket(boost::asio::local::stream_protocol::acceptor& acceptor);
  bool peer_allowed(const http::Peer& peer) const;
  boost::asio::io_context& m_ioc;
  std::filesystem::path m_path;
  bool m_owns_path = false;
  bool m_system = false;
  std::unique_ptr<DaemonHandler> m_handler;
  std::unique_ptr<http::UnixListener> m_listener;
};

} // namespace mep::daemon
