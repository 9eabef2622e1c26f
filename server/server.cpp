// The control plane's main loop: open the store, bind, serve, sweep, shut down cleanly.
#include "mep/server.hpp"

#include "mep/spanner/store.hpp"

#include "mep/config.hpp"
#include "mep/http/edge.hpp"
#include "mep/router.hpp"
#include "mep/log.hpp"
#include "mep/problem.hpp"
#include "mep/pg_store.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/sweeper.hpp"

#include <boost/asio/ip/address.hpp>
#include <fmt/format.h>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <thread>

namespace mep::server {
namespace net = boost::asio;
using tcp = net::ip::tcp;

void refuse_newer_schema(std::int64_t version, int ours) {
  if (version > ours)
    throw std::runtime_error(
        fmt::format("database schema version {} is newer than this mep ({}); upgrade mep", version, ours));
}

void refuse_foreign_tables(const std::string& found) {
  if (!found.empty())
    throw std::runtime_error(fmt::format("the database already has tables named as mep's ({}), which mep did not "
                                         "create; give mep a database of its own",
                                         found));
}

std::string default_db_url() { return "sqlite:" + (xdg_state_home() / "mep" / "control.db").string(); }

expected<std::string, std::string> check_db_url(const std::string& url) {
  const auto colon = url.find(':');
  std::string scheme = url.substr(0, colon == std::string::npos ? 0 : colon);
  for (char& ch : scheme) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const std::string rest = colon == std::string::npos ? std::string() : url.substr(colon);
  if ((scheme == "postgresql" || scheme == "postgres") && rest.rfind("://", 0) == 0) return scheme + rest;
  if (scheme == "spanner") {
    if (auto loc = spanner::parse_location(url); !loc) return make_unexpected(loc.error());
    return scheme + rest;
  }
  if (scheme == "sqlite") {
    if (rest.find_first_not_of(":/") == std::string::npos)
      return make_unexpected(std::string("--db sqlite: needs a path"));
    return scheme + rest;
  }
  return make_unexpected(
      std::string("--db must be sqlite:PATH, postgresql://USER@HOST/DATABASE or "
                  "spanner:projects/P/instances/I/databases/D, and this one begins with none of them"));
}

std::unique_ptr<Store> open_store(const std::string& given, const StoreOptions& options) {
  auto url = check_db_url(given);
  if (!url) throw std::runtime_error(url.error());
  if (pg::is_pg_url(*url)) return std::make_unique<PgStore>(*url, options);
  if (url->rfind("spanner:", 0) == 0) return std::make_unique<spanner::SpannerStore>(*url, options);
  return std::make_unique<SqliteStore>(*url, options.create, options.writer_nice, options.serving);
}

namespace {
/// SIGTERM: how long requests in flight may take before the queued ones are refused.
constexpr auto k_drain_time = std::chrono::seconds(5);
/// Then: how long the operations running in the database may take (its statement timeout
/// is 10 s) before the server stops without their answers.
constexpr auto k_running_grace = std::chrono::seconds(11);
} // namespace

int run_server(const ServerOptions& o) {
  log::set_program("mep server");
  http::raise_open_files_limit(); // one descriptor per connection
  // 1. Check the options together and report every problem at once.
  std::vector<std::string> errors;
  log::Level level;
  if (!log::parse_level(o.log_level, level))
    errors.push_back("--log-level must be debug, info, warn or error");
  else
    log::set_level(level);
  auto endpoint = http::parse_listen(o.listen);
  if (!endpoint) errors.push_back("--listen must be HOST:PORT with an IP address (got \"" + o.listen + "\")");
  bool tls = !o.tls_cert.empty() || !o.tls_key.empty();
  if (tls && (o.tls_cert.empty() || o.tls_key.empty())) errors.push_back("--tls-cert and --tls-key go together");
  if (endpoint && !endpoint->address().is_loopback() && !tls && !o.insecure_plaintext)
    errors.push_back("refusing to serve plain HTTP on " + o.listen +
                     ", which is not a loopback address: give --tls-cert and --tls-key, or "
                     "--insecure-plaintext if a TLS proxy sits in front");
  if (!std::isfinite(o.rate_limit) || o.rate_limit < 0) errors.push_back("--rate-limit must be 0 (off) or positive");
  if (!errors.empty()) {
    for (const auto& e : errors) log::error("{}", e);
    return exit_code::usage;
  }

  // 2. Open the database (creating and migrating it) and the TLS context.
  std::unique_ptr<Store> store;
  std::unique_ptr<net::ssl::context> tls_ctx;
  try {
    StoreOptions so = o.store;
    so.serving = true;
    store = open_store(o.db_url.empty() ? default_db_url() : o.db_url, so);
    if (tls) tls_ctx = http::make_tls_context(o.tls_cert, o.tls_key);
    // A new database (a mistyped path, say) holds no token: say so, rather than answer
    // every request with 401 and leave the operator to guess why.
    const auto tokens = store->list_tokens(std::nullopt);
    if (std::none_of(tokens.begin(), tokens.end(), [](const TokenInfo& t) { return !t.revoked_at; }))
      log::warn("the database holds no token that is not revoked, so every request will be refused (401); "
                "create one with mep token create --db (the same database)");
  } catch (const std::exception& e) {
    log::error("{}", e.what());
    return exit_code::other;
  }

  // 3. Bind and start serving.
  std::signal(SIGPIPE, SIG_IGN);
  net::io_context ioc(o.threads);
  store->set_completion_executor([&ioc](std::function<void()> f) { net::post(ioc, std::move(f)); });
  Router router(*store, o.rate_limit);
  router.service().set_max_hold(o.max_hold_s);
  std::unique_ptr<http::TcpListener> http;
  try {
    http = std::make_unique<http::TcpListener>(ioc, *endpoint, router, tls_ctx.get(), http::EdgeOptions{});
  } catch (const boost::system::system_error& e) {
    log::error("cannot listen on {}: {}", o.listen, e.code().message());
    return exit_code::other;
  }
  http->start();
  auto sweeper = std::make_unique<Sweeper>(*store);

  // 4. SIGTERM/SIGINT: stop accepting, let requests in flight finish (5 s). Then the
  //    operations still queued for the database (held up behind a lock, say) are answered
  //    503 (they never ran), and those running get until the database's statement timeout
  //    (10 s) to end: every request gets its answer, and none is told 503 after it was done.
  net::signal_set signals(ioc, SIGINT, SIGTERM);
  net::steady_timer drain(ioc);
  auto deadline = std::make_shared<std::chrono::steady_clock::time_point>();
  bool refused_queued = false;
  std::function<void()> wait_drain = [&] {
    const auto now = std::chrono::steady_clock::now();
    if (http->in_flight() == 0) return ioc.stop();
    if (now >= *deadline) {
      if (refused_queued) {
        log::warn("{} requests still running in the database get no answer", http->in_flight());
        return ioc.stop();
      }
      refused_queued = true;
      Problem why(Code::unavailable, "the server is shutting down; the request was not carried out");
      why.retry_after_s = 1;
      store->refuse_queued(why);
      *deadline = now + k_running_grace;
    }
    drain.expires_after(std::chrono::milliseconds(20));
    drain.async_wait([&](boost::system::error_code) { wait_drain(); });
  };
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (ec) return;
    log::info("signal {}: shutting down", sig);
    http->stop_accepting();
    router.end_waits(); // waiting claims get 503 and Retry-After now, not after the drain
    *deadline = std::chrono::steady_clock::now() + k_drain_time;
    wait_drain();
  });

  auto ep = http->local_endpoint();
  std::string host = ep.address().is_v6() ? "[" + ep.address().to_string() + "]" : ep.address().to_string();
  std::fprintf(stderr, "mep server listening on %s://%s:%u\n", tls ? "https" : "http", host.c_str(),
               static_cast<unsigned>(ep.port()));
  std::fflush(stderr);

  std::vector<std::thread> pool;
  for (int i = 1; i < o.threads; ++i) pool.emplace_back([&] { http::run_io_thread(ioc); });
  http::run_io_thread(ioc);
  for (auto& t : pool) t.join();
  // The store finishes what it has queued and stops its threads while the io_context it
  // posts completions to still exists (stopped: they are dropped, not run).
  sweeper.reset();
  store.reset();
  log::info("stopped");
  return exit_code::ok;
}

} // namespace mep::server
