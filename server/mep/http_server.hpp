// The control plane's HTTP(S) listener on Boost.Beast: asynchronous sessions with
// request limits, timeouts and keep-alive, handing each request to the Router.
#pragma once
#include "mep/router.hpp"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl/context.hpp>

#include <atomic>
#include <memory>
#include <optional>

namespace mep::server {

/// Accepts connections and runs sessions until stop() is called.
class HttpServer {
public:
  /// Binds `endpoint` (port 0 picks a free one). `tls` enables HTTPS (TLS 1.3 only).
  /// Throws boost::system::system_error when the address cannot be bound.
  HttpServer(boost::asio::io_context& ioc, boost::asio::ip::tcp::endpoint endpoint, Router& router,
             boost::asio::ssl::context* tls);

  /// The bound address (with the real port).
  boost::asio::ip::tcp::endpoint local_endpoint() const;
  /// Starts accepting.
  void start();
  /// Stops accepting new connections; sessions in flight finish their request.
  void stop_accepting();
  /// Requests currently being handled.
  int in_flight() const { return m_in_flight->load(); }

private:
  void do_accept();

  boost::asio::io_context& m_ioc;
  boost::asio::ip::tcp::acceptor m_acceptor;
  Router& m_router;
  boost::asio::ssl::context* m_tls;
  std::shared_ptr<std::atomic<int>> m_in_flight = std::make_shared<std::atomic<int>>(0);
};

/// A TLS 1.3-only server context from PEM files; throws with a readable message.
std::unique_ptr<boost::asio::ssl::context> make_tls_context(const std::string& cert_file,
                                                            const std::string& key_file);

} // namespace mep::server
