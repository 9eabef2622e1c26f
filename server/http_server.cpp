// Beast sessions for the control plane, modelled on Beast's advanced server example:
// the session reads one request (with limits and a deadline), hands it to the Router,
// writes the response, and loops while the client keeps the connection alive.
#include "mep/http_server.hpp"

#include "mep/expect_continue.hpp"
#include "mep/log.hpp"

#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include <openssl/ssl.h>

#include <chrono>

namespace mep::server {
namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

// A whole request (including an idle keep-alive wait) must arrive within this time;
// it bounds slow clients. Writes get the same deadline.
constexpr auto k_io_timeout = std::chrono::seconds(30);
constexpr auto k_handshake_timeout = std::chrono::seconds(10);

template <class Derived>
class Session {
public:
  Session(Router& router, Peer peer, std::shared_ptr<std::atomic<int>> in_flight)
      : m_router(router), m_peer(peer), m_in_flight(std::move(in_flight)) {}

protected:
  Derived& self() { return static_cast<Derived&>(*this); }

  void do_read() {
    m_parser.emplace();
    m_parser->body_limit(k_batch_body_limit);
    m_parser->header_limit(k_header_limit);
    beast::get_lowest_layer(self().stream()).expires_after(k_io_timeout);
    m_continue_sent = false;
    read_some();
  }

  // Reads until the request is whole. A client that sent `Expect: 100-continue` waits for
  // a 100 before it sends the body (RFC 9110 §10.1.1); it gets one once the header is read
  // and accepted. One that announces a body over its route's limit gets the 413 instead,
  // without sending the body (the parser itself only stops bodies over the largest limit).
  void read_some() {
    http::async_read_some(self().stream(), m_buffer, *m_parser,
                          beast::bind_front_handler(&Session::on_read_some, self().shared_from_this()));
  }

  void on_read_some(beast::error_code ec, std::size_t n) {
    if (ec || m_parser->is_done()) return on_read(ec, n);
    if (owes_continue(*m_parser, m_continue_sent)) {
      const auto length = m_parser->content_length();
      if (length && *length > body_limit_for(m_parser->get().target()))
        return write(Router::problem_response(Problem(Code::payload_too_large, "the body exceeds 16 KiB"), 11, false));
      return net::async_write(self().stream(), continue_response(),
                              [self_ptr = self().shared_from_this()](beast::error_code e, std::size_t) {
                                if (e) return self_ptr->do_close();
                                self_ptr->read_some();
                              });
    }
    read_some();
  }

  void on_read(beast::error_code ec, std::size_t) {
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::connection_reset || ec == net::error::operation_aborted)
      return self().do_close();
    if (ec) {
      // A malformed or oversized request gets a problem, then the connection closes;
      // transport errors (a client that went away mid-request) just close.
      if (ec.category() != beast::error_code(http::error::body_limit).category())
        return self().do_close();
      Problem p(Code::invalid_request, "malformed HTTP request: " + ec.message());
      if (ec == http::error::body_limit) p = Problem(Code::payload_too_large, "the body is too large");
      if (ec == http::error::header_limit)
        p = Problem(Code::payload_too_large, "the request headers exceed 8 KiB");
      if (ec == http::error::partial_message) return self().do_close();
      return write(Router::problem_response(p, 11, false));
    }
    if (const char* why = framing_problem(m_parser->get()))
      return write(Router::problem_response(Problem(Code::invalid_request, why), 11, false));
    ++*m_in_flight;
    auto self_ptr = self().shared_from_this();
    // The reply may come from a store thread or, for a whole committed batch, from an I/O
    // thread: dispatch runs it at once when this thread may enter the session's strand,
    // and queues it otherwise.
    m_router.handle(m_parser->release(), m_peer, [self_ptr](HttpResponse&& res) {
      auto shared = std::make_shared<HttpResponse>(std::move(res));
      net::dispatch(self_ptr->stream().get_executor(), [self_ptr, shared] {
        --*self_ptr->m_in_flight;
        self_ptr->write(std::move(*shared));
      });
    });
  }

  void write(HttpResponse&& res) {
    m_response = std::move(res);
    m_close = !m_response.keep_alive();
    beast::get_lowest_layer(self().stream()).expires_after(k_io_timeout);
    http::async_write(self().stream(), m_response,
                      beast::bind_front_handler(&Session::on_write, self().shared_from_this()));
  }

  void on_write(beast::error_code ec, std::size_t) {
    if (ec || m_close) return self().do_close();
    do_read();
  }

  Router& m_router;
  Peer m_peer;
  std::shared_ptr<std::atomic<int>> m_in_flight;
  beast::flat_buffer m_buffer;
  std::optional<http::request_parser<http::string_body>> m_parser;
  HttpResponse m_response;
  bool m_close = false;
  bool m_continue_sent = false;
};

class PlainSession : public Session<PlainSession>, public std::enable_shared_from_this<PlainSession> {
public:
  PlainSession(tcp::socket&& s, Router& r, Peer p, std::shared_ptr<std::atomic<int>> f)
      : Session(r, p, std::move(f)), m_stream(std::move(s)) {}
  beast::tcp_stream& stream() { return m_stream; }
  void run() {
    net::dispatch(m_stream.get_executor(), [self = shared_from_this()] { self->do_read(); });
  }
  void do_close() {
    beast::error_code ec;
    m_stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  }

private:
  friend class Session<PlainSession>;
  beast::tcp_stream m_stream;
};

class TlsSession : public Session<TlsSession>, public std::enable_shared_from_this<TlsSession> {
public:
  TlsSession(tcp::socket&& s, net::ssl::context& ctx, Router& r, Peer p, std::shared_ptr<std::atomic<int>> f)
      : Session(r, p, std::move(f)), m_stream(std::move(s), ctx) {}
  beast::ssl_stream<beast::tcp_stream>& stream() { return m_stream; }
  void run() {
    net::dispatch(m_stream.get_executor(), [self = shared_from_this()] {
      beast::get_lowest_layer(self->m_stream).expires_after(k_handshake_timeout);
      self->m_stream.async_handshake(net::ssl::stream_base::server,
                                     beast::bind_front_handler(&TlsSession::on_handshake, self));
    });
  }
  void on_handshake(beast::error_code ec) {
    if (ec) return; // a failed handshake just drops the connection
    do_read();
  }
  void do_close() {
    beast::get_lowest_layer(m_stream).expires_after(k_handshake_timeout);
    m_stream.async_shutdown([self = shared_from_this()](beast::error_code) {});
  }

private:
  friend class Session<TlsSession>;
  beast::ssl_stream<beast::tcp_stream> m_stream;
};

} // namespace

HttpServer::HttpServer(net::io_context& ioc, tcp::endpoint endpoint, Router& router, net::ssl::context* tls)
    : m_ioc(ioc), m_acceptor(net::make_strand(ioc)), m_router(router), m_tls(tls) {
  m_acceptor.open(endpoint.protocol());
  m_acceptor.set_option(net::socket_base::reuse_address(true));
  m_acceptor.bind(endpoint);
  m_acceptor.listen(net::socket_base::max_listen_connections);
}

tcp::endpoint HttpServer::local_endpoint() const { return m_acceptor.local_endpoint(); }

void HttpServer::start() { do_accept(); }

void HttpServer::stop_accepting() {
  net::post(m_acceptor.get_executor(), [this] {
    beast::error_code ec;
    m_acceptor.close(ec);
  });
}

void HttpServer::do_accept() {
  m_acceptor.async_accept(net::make_strand(m_ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !m_acceptor.is_open()) return;
    if (!ec) {
      beast::error_code ep_ec;
      auto remote = socket.remote_endpoint(ep_ec);
      Peer peer{!ep_ec && remote.address().is_loopback()};
      socket.set_option(tcp::no_delay(true), ep_ec);
      if (m_tls)
        std::make_shared<TlsSession>(std::move(socket), *m_tls, m_router, peer, m_in_flight)->run();
      else
        std::make_shared<PlainSession>(std::move(socket), m_router, peer, m_in_flight)->run();
    } else {
      log::warn("accept failed: {}", ec.message());
    }
    do_accept();
  });
}

std::unique_ptr<net::ssl::context> make_tls_context(const std::string& cert_file, const std::string& key_file) {
  auto ctx = std::make_unique<net::ssl::context>(net::ssl::context::tls_server);
  SSL_CTX_set_min_proto_version(ctx->native_handle(), TLS1_3_VERSION);
  SSL_CTX_set_max_proto_version(ctx->native_handle(), TLS1_3_VERSION);
  boost::system::error_code ec;
  ctx->use_certificate_chain_file(cert_file, ec);
  if (ec) throw std::runtime_error("cannot load TLS certificate " + cert_file + ": " + ec.message());
  ctx->use_private_key_file(key_file, net::ssl::context::pem, ec);
  if (ec) throw std::runtime_error("cannot load TLS key " + key_file + ": " + ec.message());
  return ctx;
}

} // namespace mep::server
