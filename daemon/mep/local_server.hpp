// mepd's HTTP/1.1 server on a Unix socket (SPEC §7): peers checked with SO_PEERCRED,
// requests routed to the Keeper, the NDJSON event stream on GET /v1/events.
#pragma once
#include "mep/keeper.hpp"

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>

#include <filesystem>
#include <memory>
#include <sys/types.h>

namespace mep::daemon {

class LocalServer {
public:
  /// Listens on `socket_path` (the directory is created 0700, the socket is 0600), or on
  /// the socket systemd handed over (`inherited_fd` ≥ 0). Throws std::runtime_error.
  LocalServer(boost::asio::io_context& ioc, Keeper& keeper, const std::filesystem::path& socket_path,
              int inherited_fd);
  ~LocalServer();
  void start();
  void stop();

  struct PeerCredView {
    uid_t uid;
    gid_t gid;
  };

private:
  bool peer_allowed(const PeerCredView& peer) const;
  void do_accept();
  boost::asio::io_context& m_ioc;
  Keeper& m_keeper;
  std::filesystem::path m_path;
  bool m_owns_path = false;
  boost::asio::local::stream_protocol::acceptor m_acceptor;
};

} // namespace mep::daemon
