// The HTTP edge's sessions, modelled on Beast's advanced server example: a session reads a
// request header, asks its Handler what body the request may carry, reads the body (into a
// string, or into the handler's sink), hands the request over, writes the answer, and loops
// while the client keeps the connection alive.
//
// Design notes.
// * One template, Session<Stream>, for plain TCP, TLS over TCP and Unix sockets: the only
//   differences are the handshake and how a connection is closed (Stream traits below).
// * Deadlines: a request header must arrive within io_timeout of the read starting (an idle
//   keep-alive wait included), so slow-loris clients are cut off. A body read into memory
//   has the same whole-request deadline; a streamed body (a sink) and every write get an
//   idle deadline instead, re-armed on progress, so a large object moves at any sane rate.
// * Refusals before the body (framing, a plan that refuses, an announced length over the
//   limit) answer at once and then close *lingering* (nginx's lingering_close): the write
//   side is shut down, and what the client still sends is read and dropped for at most
//   linger_time and linger_bytes. Closing with unread bytes would make the kernel send a
//   reset, and a client that sends its whole body before it reads would lose the answer.
// * Exception boundary: a handler that throws gets its request answered 500 internal (if
//   it had not answered yet); the session goes on. run_io_thread() guards the I/O threads.
#include "mep/http/edge.hpp"

#include "mep/http/framing.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/uuid.hpp"

#include <sys/resource.h>
#include <algorithm>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/json/serialize.hpp>
#include <boost/url/parse.hpp>

#include <fmt/format.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <cerrno>
#include <deque>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <variant>

namespace mep::http {
namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = net::ip::tcp;
using local = net::local::stream_protocol;

// ---- small pieces ---------------------------------------------------------------------------

std::string format_size(std::size_t bytes) {
  constexpr std::size_t k = 1024;
  if (bytes >= k * k * k && bytes % (k * k * k) == 0) return fmt::format("{} GiB", bytes / (k * k * k));
  if (bytes >= k * k && bytes % (k * k) == 0) return fmt::format("{} MiB", bytes / (k * k));
  if (bytes >= k && bytes % k == 0) return fmt::format("{} KiB", bytes / k);
  return fmt::format("{} bytes", bytes);
}

Response problem_response(Problem p, unsigned version, bool keep_alive, std::string_view server_name) {
  p.instance = uuid_v7().to_string();
  Response res{static_cast<bhttp::status>(p.status()), version};
  res.set(bhttp::field::server, server_name);
  res.set("X-Request-Id", p.instance);
  res.set(bhttp::field::content_type, "application/problem+json");
  res.set(bhttp::field::cache_control, "no-store");
  if (p.retry_after_s) res.set(bhttp::field::retry_after, std::to_string(*p.retry_after_s));
  if (p.code == Code::unauthenticated) res.set(bhttp::field::www_authenticate, "Bearer realm=\"mep\"");
  res.body() = json::dump(p.to_json());
  res.keep_alive(keep_alive);
  res.prepare_payload();
  return res;
}

std::string allow_entry(Verb v) { return v == Verb::get ? "GET, HEAD" : std::string(bhttp::to_string(v)); }

std::optional<Problem> json_body_problem(const bhttp::fields& headers) {
  auto trim = [](std::string_view v) {
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
    return v;
  };
  if (headers.count(bhttp::field::content_type) > 1)
    return Problem(Code::invalid_request, "more than one Content-Type header");
  const std::string_view whole = headers[bhttp::field::content_type];
  const std::size_t semi = std::min(whole.find(';'), whole.size());
  // JSON is UTF-8 (RFC 8259 §8.1): a charset parameter, if any, must say so (Beast reads
  // the parameters, quoted values included).
  bool utf8 = true;
  for (const auto& [name, value] : bhttp::param_list{whole.substr(semi)})
    if (beast::iequals(name, "charset")) utf8 = beast::iequals(value, "utf-8");
  if (!beast::iequals(trim(whole.substr(0, semi)), "application/json") || !utf8)
    return Problem(Code::unsupported_media_type, "the request body must be application/json in UTF-8");
  // Bodies are not encoded (no gzip): one that is would only fail to parse.
  for (auto [it, end] = headers.equal_range(bhttp::field::content_encoding); it != end; ++it)
    if (!beast::iequals(trim(it->value()), "identity"))
      return Problem(Code::unsupported_media_type, "the request body must not be encoded (Content-Encoding)");
  return std::nullopt;
}

std::optional<std::string_view> bearer_token(std::string_view v) {
  if (v.size() < 7 || !beast::iequals(v.substr(0, 6), "Bearer") || v[6] != ' ') return std::nullopt;
  v.remove_prefix(7);
  while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
  while (!v.empty() && v.back() == ' ') v.remove_suffix(1);
  return v;
}

std::optional<Target> parse_target(std::string_view target) {
  auto u = boost::urls::parse_origin_form(target);
  if (!u) return std::nullopt;
  Target t;
  for (auto s : u->segments()) t.segments.emplace_back(s);
  if (t.segments.empty()) t.segments.emplace_back();
  for (auto q : u->params()) t.query.emplace_back(std::string(q.key), std::string(q.value));
  return t;
}

bool match_pattern(std::string_view pattern, const std::vector<std::string>& segs, std::vector<std::string>& params) {
  std::vector<std::string> found;
  std::size_t i = 1, n = 0;
  while (i <= pattern.size()) {
    std::size_t j = pattern.find('/', i);
    if (j == std::string_view::npos) j = pattern.size();
    std::string_view p = pattern.substr(i, j - i);
    if (n >= segs.size()) return false;
    if (p.size() > 2 && p.front() == '{') {
      if (segs[n].empty()) return false;
      found.push_back(segs[n]);
    } else if (p != segs[n]) {
      return false;
    }
    ++n;
    i = j + 1;
  }
  if (n != segs.size()) return false;
  params = std::move(found);
  return true;
}

namespace {

// A request body handed to a BodySink as it arrives (Beast's Body concept, reader side).
struct SinkBody {
  struct value_type {
    BodySink* sink = nullptr;
    std::optional<Problem> problem; // why the sink stopped the read
  };
  struct reader {
    template <bool isRequest, class Fields>
    reader(bhttp::header<isRequest, Fields>&, value_type& body) : m_body(body) {}
    void init(const boost::optional<std::uint64_t>&, beast::error_code& ec) { ec = {}; }
    template <class ConstBufferSequence>
    std::size_t put(const ConstBufferSequence& buffers, beast::error_code& ec) {
      std::size_t n = 0;
      for (auto b : beast::buffers_range_ref(buffers)) {
        if (auto p = m_body.sink->write(b.data(), b.size())) {
          m_body.problem = std::move(p);
          ec = net::error::no_buffer_space; // recognized by on_read_error through `problem`
          return n;
        }
        n += b.size();
      }
      ec = {};
      return n;
    }
    void finish(beast::error_code& ec) { ec = {}; }

  private:
    value_type& m_body;
  };
};

// Stream traits: the lowest layer's socket, the handshake, the close.
// How much one read of a streamed body asks for: the buffer a connection keeps while it
// streams (64 uploads at once: 16 MiB).
constexpr std::size_t k_sink_read_size = 256 * 1024;

template <class Stream>
constexpr bool k_is_tls = false;
template <>
constexpr bool k_is_tls<beast::ssl_stream<beast::tcp_stream>> = true;

} // namespace

// ---- sessions -------------------------------------------------------------------------------

class SessionBase : public std::enable_shared_from_this<SessionBase> {
public:
  virtual ~SessionBase() = default;
  virtual void deliver(Response&& res) = 0;
  virtual void deliver(FileResponse&& res) = 0;
  virtual std::shared_ptr<OpenStream> open_stream(std::string_view content_type) = 0;
  virtual int native_handle() = 0;
};

void Responder::send(Response&& res) const { m_session->deliver(std::move(res)); }
void Responder::send_file(FileResponse&& res) const { m_session->deliver(std::move(res)); }
std::shared_ptr<OpenStream> Responder::stream(std::string_view content_type) const {
  return m_session->open_stream(content_type);
}
int Responder::native_handle() const { return m_session->native_handle(); }

namespace {

// The state of an open response stream, shared by the producer (push, any thread) and the
// session (its strand).
class StreamState final : public OpenStream {
public:
  using Pump = std::function<void(std::string)>;
  explicit StreamState(Pump pump) : m_pump(std::move(pump)) {}
  void push(std::string bytes) override {
    {
      std::lock_guard lock(m_mutex);
      if (m_closed) return;
    }
    m_pump(std::move(bytes));
  }
  void on_close(std::function<void()> f) override {
    {
      std::lock_guard lock(m_mutex);
      if (!m_closed) {
        m_on_close.push_back(std::move(f));
        return;
      }
    }
    f();
  }
  void close() {
    std::vector<std::function<void()>> fs;
    {
      std::lock_guard lock(m_mutex);
      if (m_closed) return;
      m_closed = true;
      fs.swap(m_on_close);
    }
    for (auto& f : fs) f();
  }

private:
  Pump m_pump;
  std::mutex m_mutex;
  bool m_closed = false;
  std::vector<std::function<void()>> m_on_close;
};

template <class Stream>
class Session final : public SessionBase {
public:
  Session(Stream&& stream, Handler& handler, Peer peer, const EdgeOptions& options,
          std::shared_ptr<std::atomic<int>> in_flight)
      : m_stream(std::move(stream)), m_handler(handler), m_peer(peer), m_options(options),
        m_in_flight(std::move(in_flight)) {}

  ~Session() override {
    if (m_events) m_events->close();
  }

  void run() {
    net::dispatch(m_stream.get_executor(), [self = shared()] {
      if constexpr (k_is_tls<Stream>) {
        beast::get_lowest_layer(self->m_stream).expires_after(self->m_options.handshake_timeout);
        self->m_stream.async_handshake(net::ssl::stream_base::server, [self](beast::error_code ec) {
          if (!ec) self->start(); // a failed handshake just drops the connection
        });
      } else {
        self->start();
      }
    });
  }

  int native_handle() override { return lowest().socket().native_handle(); }

  void deliver(Response&& res) override { deliver_any(std::make_shared<Response>(std::move(res))); }
  void deliver(FileResponse&& res) override { deliver_any(std::make_shared<FileResponse>(std::move(res))); }

  std::shared_ptr<OpenStream> open_stream(std::string_view content_type) override {
    std::weak_ptr<Session> weak = shared();
    auto exec = m_stream.get_executor();
    auto state = std::make_shared<StreamState>([weak, exec](std::string bytes) {
      net::post(exec, [weak, bytes = std::move(bytes)]() mutable {
        if (auto s = weak.lock()) s->queue_chunk(std::move(bytes));
      });
    });
    std::string head = fmt::format("HTTP/1.1 200 OK\r\nServer: {}\r\nContent-Type: {}\r\nCache-Control: no-store\r\n"
                                   "Connection: close\r\n\r\n",
                                   m_options.server_name, content_type);
    net::dispatch(exec, [self = shared(), state, head = std::move(head)]() mutable {
      self->answered();
      self->m_events = state;
      beast::get_lowest_layer(self->m_stream).expires_never();
      self->queue_chunk(std::move(head));
      self->watch_for_close();
    });
    return state;
  }

private:
  std::shared_ptr<Session> shared() { return std::static_pointer_cast<Session>(shared_from_this()); }
  auto& lowest() { return beast::get_lowest_layer(m_stream); }

  void start() {
    if (auto p = m_handler.admit(m_peer)) return refuse(std::move(*p));
    do_read();
  }

  // ---- reading ----

  void do_read() {
    m_header.emplace();
    m_header->header_limit(static_cast<std::uint32_t>(m_options.header_limit));
    // The header parser must not judge the body: plan() gives each request its own limit.
    m_header->body_limit(std::numeric_limits<std::uint64_t>::max());
    m_string.reset();
    m_sinked.reset();
    m_sink.reset();
    m_continue_sent = false;
    m_head = false;
    m_answered = false;
    m_counted = false;
    lowest().expires_after(m_options.io_timeout);
    bhttp::async_read_header(m_stream, m_buffer, *m_header,
                             [self = shared()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return on_read_error(ec);
    const auto& h = m_header->get();
    m_version = h.version();
    m_head = h.method() == Verb::head;
    if (const char* why = framing_problem(h)) return refuse(Problem(Code::invalid_request, why));
    BodyPlan plan;
    try {
      plan = m_handler.plan(h.base(), m_peer);
    } catch (const std::exception& e) {
      log::error("request refused: planning its body failed: {}", e.what());
      return refuse(Problem(Code::internal, "internal error"));
    }
    if (plan.refuse) return refuse(std::move(*plan.refuse));
    m_limit = plan.limit;
    if (auto length = m_header->content_length(); length && *length > m_limit) return refuse(too_large());
    const bool expects = beast::iequals(h[bhttp::field::expect], "100-continue") && !m_header->is_done();
    if (plan.sink) {
      m_sink = std::move(plan.sink);
      // A streamed body is read in large pieces: the buffer's spare capacity is what one
      // read asks the socket for (512 bytes when it never grew, a system call per 512 bytes).
      m_buffer.reserve(k_sink_read_size);
      m_sinked.emplace(std::move(*m_header));
      m_sinked->body_limit(m_limit);
      m_sinked->get().body().sink = m_sink.get();
    } else {
      m_string.emplace(std::move(*m_header));
      m_string->body_limit(m_limit);
    }
    m_header.reset();
    if (expects) {
      // The client waits for this before it sends the body (RFC 9110 §10.1.1).
      m_continue_sent = true;
      return net::async_write(m_stream, continue_response(), [self = shared()](beast::error_code e, std::size_t) {
        if (e) return self->close_now();
        self->read_body();
      });
    }
    read_body();
  }

  void read_body() {
    if (m_sinked) return read_some(*m_sinked);
    read_some(*m_string);
  }

  template <class Parser>
  void read_some(Parser& parser) {
    // Bytes that arrived with the header (usually the whole body of a small request) are
    // parsed here: no second trip through the scheduler for them.
    // One put parses one piece (a chunk of a chunked body, say): it goes on while it uses
    // bytes, until it needs more than the buffer holds.
    while (!parser.is_done() && m_buffer.size() > 0) {
      beast::error_code ec;
      const std::size_t used = parser.put(m_buffer.data(), ec);
      m_buffer.consume(used);
      if (ec == bhttp::error::need_more) break;
      if (ec) return on_read_error(ec);
      if (used == 0) break;
    }
    if (parser.is_done()) return dispatch_request();
    if (m_sinked) {
      lowest().expires_after(m_options.io_timeout); // idle deadline for a streamed body
      // Beast's read_some asks the socket for 64 KiB at most (beast::read_size). A streamed
      // body is read in pieces of k_sink_read_size instead, and handed to the parser at the
      // top of this function, which passes its bytes on to the sink: a quarter of the reads,
      // wake-ups and write(2)s for a large upload (bench_store, 1 MiB objects).
      return m_stream.async_read_some(m_buffer.prepare(k_sink_read_size),
                                      [self = shared()](beast::error_code ec, std::size_t n) {
                                        if (ec) return self->on_read_error(ec);
                                        self->m_buffer.commit(n);
                                        self->read_body();
                                      });
    }
    bhttp::async_read_some(m_stream, m_buffer, parser, [self = shared()](beast::error_code ec, std::size_t) {
      if (ec) return self->on_read_error(ec);
      self->read_body();
    });
  }

  void on_read_error(beast::error_code ec) {
    // A client that went away, or an idle connection timing out, just closes.
    if (ec == bhttp::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::connection_reset || ec == net::error::operation_aborted ||
        ec == bhttp::error::partial_message)
      return close_now();
    if (m_sinked && m_sinked->get().body().problem) return refuse(std::move(*m_sinked->get().body().problem));
    if (ec == bhttp::error::body_limit) return refuse(too_large());
    if (ec == bhttp::error::header_limit)
      return refuse(
          Problem(Code::payload_too_large, "the request headers exceed " + format_size(m_options.header_limit)));
    if (ec.category() == beast::error_code(bhttp::error::bad_target).category())
      return refuse(Problem(Code::invalid_request, "malformed HTTP request: " + ec.message()));
    close_now(); // a transport error
  }

  Problem too_large() const { return Problem(Code::payload_too_large, "the body exceeds " + format_size(m_limit)); }

  void dispatch_request() {
    Request req;
    if (m_sinked)
      req = Request(std::move(m_sinked->release().base()));
    else
      req = m_string->release();
    m_keep_alive = req.keep_alive();
    ++*m_in_flight;
    m_counted = true;
    auto sink = m_sink;
    try {
      m_handler.handle(std::move(req), m_peer, std::move(sink), Responder(shared()));
    } catch (const std::exception& e) {
      log::error("request handler failed: {}", e.what());
      deliver(problem_response(Problem(Code::internal, "internal error"), m_version, false, m_options.server_name));
    }
  }

  // ---- writing ----

  // Marks the request answered; one that reached the handler leaves the in-flight count.
  void answered() {
    if (m_counted) --*m_in_flight;
    m_counted = false;
    m_answered = true;
  }

  template <class Message>
  void deliver_any(std::shared_ptr<Message> msg) {
    net::dispatch(m_stream.get_executor(), [self = shared(), msg]() mutable {
      if (self->m_answered) return; // one answer per request
      self->answered();
      // Decided before msg is moved from: the order of evaluating arguments is unspecified.
      const After after = self->m_keep_alive && msg->keep_alive() ? After::read : After::close;
      self->write(std::move(msg), after);
    });
  }

  enum class After { read, close, linger };

  template <class Message>
  void write(std::shared_ptr<Message> msg, After after) {
    if (m_head) {
      // HEAD: the head GET would have, Content-Length included, and no content.
      auto head = std::make_shared<bhttp::response<bhttp::empty_body>>(std::move(msg->base()));
      return write_serialized(head, after);
    }
    write_serialized(msg, after);
  }

  template <class Message>
  void write_serialized(std::shared_ptr<Message> msg, After after) {
    using Serializer = bhttp::serializer<false, typename Message::body_type, typename Message::fields_type>;
    auto sr = std::make_shared<Serializer>(*msg);
    write_some(std::move(msg), std::move(sr), after);
  }

  template <class Message, class Serializer>
  void write_some(std::shared_ptr<Message> msg, std::shared_ptr<Serializer> sr, After after) {
    lowest().expires_after(m_options.io_timeout); // an idle deadline: a large body moves on
    bhttp::async_write_some(m_stream, *sr,
                            [self = shared(), msg, sr, after](beast::error_code ec, std::size_t) mutable {
                              if (ec) return self->close_now();
                              if (!sr->is_done()) return self->write_some(std::move(msg), std::move(sr), after);
                              switch (after) {
                              case After::read:
                                return self->do_read();
                              case After::close:
                                return self->close_graceful();
                              case After::linger:
                                return self->linger();
                              }
                            });
  }

  // Answers with `p` without reading the request's body (maybe never sent, maybe on its
  // way), then closes lingering.
  void refuse(Problem p) {
    // What the request was going into is let go now, not when the connection ends.
    m_sinked.reset();
    m_sink.reset();
    m_head = false;
    answered();
    write(std::make_shared<Response>(problem_response(std::move(p), m_version, false, m_options.server_name)),
          After::linger);
  }

  // ---- closing ----

  void close_now() {
    m_sinked.reset();
    m_sink.reset();
    beast::error_code ec;
    lowest().socket().shutdown(net::socket_base::shutdown_both, ec);
    lowest().socket().close(ec);
  }

  void close_graceful() {
    if constexpr (k_is_tls<Stream>) {
      lowest().expires_after(m_options.handshake_timeout);
      m_stream.async_shutdown([self = shared()](beast::error_code) { self->close_now(); });
    } else {
      beast::error_code ec;
      lowest().socket().shutdown(net::socket_base::shutdown_send, ec);
    }
  }

  void linger() {
    beast::error_code ec;
    lowest().socket().shutdown(net::socket_base::shutdown_send, ec);
    m_linger_until = std::chrono::steady_clock::now() + m_options.linger_time;
    m_lingered = m_buffer.size(); // what the parser had buffered counts too
    m_buffer.clear();
    drain();
  }

  void drain() {
    auto left = m_linger_until - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero() || m_lingered >= m_options.linger_bytes) return close_now();
    lowest().expires_after(left);
    m_drain.resize(64 * 1024);
    lowest().async_read_some(net::buffer(m_drain), [self = shared()](beast::error_code ec, std::size_t n) {
      if (ec) return self->close_now(); // EOF: the client has read the answer and closed
      self->m_lingered += n;
      self->drain();
    });
  }

  // ---- streams ----

  // A reader that does not keep up is cut off once k_stream_backlog bytes wait for it: its
  // queue would otherwise grow for as long as it stays connected, and one client could take
  // the daemon's memory. It has missed events either way; it reconnects.
  static constexpr std::size_t k_stream_backlog = 256 * 1024;

  void queue_chunk(std::string bytes) {
    if (m_stream_done) return;
    m_queued_bytes += bytes.size();
    if (m_queued_bytes > k_stream_backlog) {
      log::warn("closed an event stream whose reader is more than {} behind", format_size(k_stream_backlog));
      return end_stream();
    }
    m_chunks.push_back(std::move(bytes));
    if (m_chunks.size() == 1) write_chunk();
  }

  // The chunk at the front is the one being written: it stays queued (and alive) until its
  // write completes, also when the stream ended meanwhile.
  void write_chunk() {
    net::async_write(m_stream, net::buffer(m_chunks.front()), [self = shared()](beast::error_code ec, std::size_t) {
      self->m_queued_bytes -= self->m_chunks.front().size();
      self->m_chunks.pop_front();
      if (ec || self->m_stream_done) {
        self->m_chunks.clear();
        self->m_queued_bytes = 0;
        return self->end_stream();
      }
      if (!self->m_chunks.empty()) self->write_chunk();
    });
  }

  // Anything the client sends on a stream is dropped; its EOF (or an error) ends the stream.
  void watch_for_close() {
    m_drain.resize(4096);
    lowest().socket().async_read_some(net::buffer(m_drain), [self = shared()](beast::error_code ec, std::size_t) {
      if (ec) return self->end_stream();
      self->watch_for_close();
    });
  }

  void end_stream() {
    if (m_stream_done) return;
    m_stream_done = true;
    // Chunks not yet started are dropped; the one being written is dropped by its completion.
    if (m_chunks.size() > 1) m_chunks.erase(m_chunks.begin() + 1, m_chunks.end());
    m_queued_bytes = m_chunks.empty() ? 0 : m_chunks.front().size();
    if (m_events) m_events->close();
    close_now();
  }

  Stream m_stream;
  Handler& m_handler;
  Peer m_peer;
  const EdgeOptions m_options;
  std::shared_ptr<std::atomic<int>> m_in_flight;
  beast::flat_buffer m_buffer;
  std::optional<bhttp::request_parser<bhttp::empty_body>> m_header;
  std::optional<bhttp::request_parser<bhttp::string_body>> m_string;
  std::optional<bhttp::request_parser<SinkBody>> m_sinked;
  std::shared_ptr<BodySink> m_sink;
  std::size_t m_limit = 0;
  unsigned m_version = 11;
  bool m_continue_sent = false;
  bool m_head = false;
  bool m_keep_alive = false;
  bool m_answered = false;
  bool m_counted = false; // the request reached the handler and is in m_in_flight
  std::chrono::steady_clock::time_point m_linger_until{};
  std::size_t m_lingered = 0;
  std::vector<char> m_drain;
  std::shared_ptr<StreamState> m_events;
  std::deque<std::string> m_chunks;
  std::size_t m_queued_bytes = 0; ///< in m_chunks
  bool m_stream_done = false;
};

} // namespace

// ---- listeners ------------------------------------------------------------------------------

TcpListener::TcpListener(net::io_context& ioc, tcp::endpoint endpoint, Handler& handler, net::ssl::context* tls,
                         EdgeOptions options)
    : m_ioc(ioc), m_acceptor(net::make_strand(ioc)), m_handler(handler), m_tls(tls), m_options(std::move(options)) {
  m_acceptor.open(endpoint.protocol());
  m_acceptor.set_option(net::socket_base::reuse_address(true));
  m_acceptor.bind(endpoint);
  m_acceptor.listen(net::socket_base::max_listen_connections);
}

tcp::endpoint TcpListener::local_endpoint() const { return m_acceptor.local_endpoint(); }

void AcceptPacing::then(const boost::system::error_code& ec, std::function<void()> next) {
  if (!ec) {
    if (m_failures > 0) log::info("accepting connections again, after {} failed attempts", m_failures);
    m_failures = 0;
    m_delay = std::chrono::milliseconds(0);
    return next();
  }
  if (m_failures++ == 0)
    log::warn("accept failed: {}; trying again in 5 ms, then less often (up to every second) until it works",
              ec.message());
  m_delay = std::min(std::max(m_delay * 2, std::chrono::milliseconds(5)), std::chrono::milliseconds(1000));
  m_timer.expires_after(m_delay);
  m_timer.async_wait([next = std::move(next)](const boost::system::error_code& e) {
    if (!e) next();
  });
}

void TcpListener::start() { do_accept(); }

void TcpListener::stop_accepting() {
  net::post(m_acceptor.get_executor(), [this] {
    beast::error_code ec;
    m_acceptor.close(ec);
    m_pacing.cancel();
  });
}

void TcpListener::do_accept() {
  m_acceptor.async_accept(net::make_strand(m_ioc), [this](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !m_acceptor.is_open()) return;
    if (!ec) {
      beast::error_code ep_ec;
      auto remote = socket.remote_endpoint(ep_ec);
      Peer peer;
      peer.loopback = !ep_ec && remote.address().is_loopback();
      socket.set_option(tcp::no_delay(true), ep_ec);
      if (m_tls) {
        using Stream = beast::ssl_stream<beast::tcp_stream>;
        std::make_shared<Session<Stream>>(Stream(std::move(socket), *m_tls), m_handler, peer, m_options, m_in_flight)
            ->run();
      } else {
        std::make_shared<Session<beast::tcp_stream>>(beast::tcp_stream(std::move(socket)), m_handler, peer, m_options,
                                                     m_in_flight)
            ->run();
      }
    }
    m_pacing.then(ec, [this] { do_accept(); });
  });
}

// The connections each user holds to a UnixListener (EdgeOptions::connections_per_uid).
struct UnixListener::UidCounts {
  struct Count {
    std::size_t open = 0;
    std::size_t refusing = 0; // connections over the limit, being answered 429
    bool warned = false;      // since it last held fewer than half its limit
  };
  std::mutex mutex;
  std::unordered_map<uid_t, Count> by_uid;
};

UnixListener::UnixListener(net::io_context& ioc, local::acceptor acceptor, Handler& handler, EdgeOptions options)
    : m_ioc(ioc), m_acceptor(std::move(acceptor)), m_handler(handler), m_options(std::move(options)),
      m_uid_counts(std::make_shared<UidCounts>()) {}

void UnixListener::start() { do_accept(); }

void UnixListener::stop_accepting() {
  net::post(m_acceptor.get_executor(), [this] {
    beast::error_code ec;
    m_acceptor.close(ec);
    m_pacing.cancel();
  });
}

namespace {

// The supplementary groups of a Unix socket's peer, as they were at connect(2): not those it
// or its pid has now (SO_PEERGROUPS, Linux 4.13).
std::optional<std::vector<gid_t>> peer_groups(int fd) {
  std::vector<gid_t> groups(32);
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      return groups;
    }
    if (errno != ERANGE) return std::nullopt;
    groups.resize(len / sizeof(gid_t) + 1); // the size it needs
  }
  return std::nullopt;
}

} // namespace

bool UnixListener::count_connection(Peer& peer) {
  const std::size_t limit = m_options.connections_per_uid;
  if (limit == 0 || !peer.cred_known ||
      std::find(m_options.uncapped_uids.begin(), m_options.uncapped_uids.end(), peer.uid) !=
          m_options.uncapped_uids.end())
    return true;
  // Refusals are answered and closed lingering (up to linger_time): a user who keeps
  // connecting past its limit would hold descriptors that way too, so past a few refusals
  // in flight its connections are closed at once, unanswered.
  constexpr std::size_t k_refusals_in_flight = 16;
  std::lock_guard lock(m_uid_counts->mutex);
  auto& count = m_uid_counts->by_uid[peer.uid];
  const bool over = count.open >= limit;
  if (over) {
    if (!count.warned)
      log::warn("uid {} holds {} connections, as many as one user may; its next ones are refused (429) until some "
                "close",
                static_cast<long>(peer.uid), count.open);
    count.warned = true;
    if (count.refusing >= k_refusals_in_flight) return false;
    peer.over_limit = true;
    ++count.refusing;
  } else {
    ++count.open;
  }
  // Given back when the last copy of the peer (the session's, a request's) is gone.
  peer.counted = std::shared_ptr<const void>(m_uid_counts.get(),
                                             [counts = m_uid_counts, uid = peer.uid, limit, over](const void*) {
                                               std::lock_guard l(counts->mutex);
                                               auto it = counts->by_uid.find(uid);
                                               if (it == counts->by_uid.end()) return;
                                               auto& c = it->second;
                                               --(over ? c.refusing : c.open);
                                               if (c.open == 0 && c.refusing == 0)
                                                 counts->by_uid.erase(it);
                                               else if (c.open < limit / 2)
                                                 c.warned = false;
                                             });
  return true;
}

void UnixListener::do_accept() {
  m_acceptor.async_accept(net::make_strand(m_ioc), [this](beast::error_code ec, local::socket socket) {
    if (ec == net::error::operation_aborted || !m_acceptor.is_open()) return;
    if (!ec) {
      Peer peer;
      peer.loopback = true;
      peer.unix_socket = true;
      ucred cred{};
      socklen_t len = sizeof cred;
      if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
        peer.cred_known = true;
        peer.pid = cred.pid;
        peer.uid = cred.uid;
        peer.gid = cred.gid;
        peer.groups = peer_groups(socket.native_handle());
      }
      if (count_connection(peer)) {
        using Stream = beast::basic_stream<local>;
        std::make_shared<Session<Stream>>(Stream(std::move(socket)), m_handler, peer, m_options, m_in_flight)->run();
      }
    }
    m_pacing.then(ec, [this] { do_accept(); });
  });
}

// Parses HOST:PORT ([v6]:PORT too); "localhost" means 127.0.0.1.
std::optional<tcp::endpoint> parse_listen(const std::string& s) {
  std::string host, port;
  if (!s.empty() && s.front() == '[') {
    auto close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':') return std::nullopt;
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    auto colon = s.rfind(':');
    if (colon == std::string::npos) return std::nullopt;
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  if (host == "localhost") host = "127.0.0.1";
  boost::system::error_code ec;
  auto addr = net::ip::make_address(host, ec);
  if (ec || port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  unsigned long p = std::stoul(port);
  if (p > 65535) return std::nullopt;
  return tcp::endpoint(addr, static_cast<unsigned short>(p));
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

std::uint64_t raise_open_files_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return static_cast<std::uint64_t>(lim.rlim_cur);
}

void run_io_thread(net::io_context& ioc) {
  for (;;) {
    try {
      ioc.run();
      return;
    } catch (const std::exception& e) {
      log::error("an I/O thread caught an exception and goes on: {}", e.what());
    }
  }
}

} // namespace mep::http
