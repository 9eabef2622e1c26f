// `mep store`: the fenced object store's routes on the HTTP edge, and its main loop.
//
// Design notes.
// * A PUT is decided in two places. Before its body is read (StoreHandler::plan): the
//   bearer token, the memory id, the Fencing-Token header, and a token already below the
//   mark — each refused at once, so a stale or unauthenticated writer does not upload a
//   gigabyte first. While the body arrives it goes straight to a new version file (an
//   UploadSink). After it (handle → commit): ObjectStore::commit applies the fence rule
//   again, atomically with making the object current; the early check is only a shortcut.
// * --strict: before the commit, the control plane's POST /v1/fence/verify is asked, with
//   the writer's own bearer token, whether the token is the live lease's. Reads and
//   advances ask it too (GET /v1/memories/{id}, fence/verify), so tenants stay apart by
//   the control plane's answer. These calls block, so they run on a worker pool.
// * Nothing secret or private is logged: no bearer token, no object byte.
#include "mep/store_server.hpp"

#include "mep/config.hpp"
#include "mep/crypto.hpp"
#include "mep/http/client.hpp"
#include "mep/http/edge.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/object_store.hpp"
#include "mep/store_headers.hpp"
#include "mep/uuid.hpp"

#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core/file.hpp>
#include <boost/beast/http.hpp>
#include <boost/json/serialize.hpp>
#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <ctime>
#include <fstream>
#include <thread>
#include <unordered_set>

namespace mep::store {
namespace net = boost::asio;
namespace bhttp = boost::beast::http;
using json::Need;
using server::Metrics;

std::string default_store_dir() { return (xdg_state_home() / "mep" / "store").string(); }

namespace {

constexpr std::size_t k_small_body = 16 * 1024;
constexpr std::int64_t k_max_token = std::numeric_limits<std::int64_t>::max();
constexpr std::string_view k_server_name = "mep store";

enum class Route { health, ready, metrics, put_object, get_object, advance, get_fence, none };

struct RouteRow {
  bhttp::verb method;
  std::string_view pattern;
  Route route;
};

const std::vector<RouteRow> k_routes = {
    {bhttp::verb::get, "/healthz", Route::health},
    {bhttp::verb::get, "/readyz", Route::ready},
    {bhttp::verb::get, "/metrics", Route::metrics},
    {bhttp::verb::put, "/v1/objects/{id}", Route::put_object},
    {bhttp::verb::get, "/v1/objects/{id}", Route::get_object},
    {bhttp::verb::post, "/v1/fence/advance", Route::advance},
    {bhttp::verb::get, "/v1/fence/{id}", Route::get_fence},
};

// The request's values of header `name`, in order.
std::vector<std::string_view> values_of(const http::RequestHeader& h, std::string_view name) {
  std::vector<std::string_view> out;
  auto range = h.equal_range(name);
  for (auto it = range.first; it != range.second; ++it) out.push_back(it->value());
  return out;
}

expected<std::int64_t, Problem> parse_fencing_token(const http::RequestHeader& h) {
  return store::parse_fencing_token(values_of(h, "Fencing-Token"));
}

expected<Precondition, Problem> parse_preconditions(const http::RequestHeader& h) {
  return store::parse_preconditions(values_of(h, "If-Match"), values_of(h, "If-None-Match"));
}

// RFC 9110 §5.6.7 IMF-fixdate.
std::string http_date(UnixMs ms) {
  std::time_t t = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%a, %d %b %Y %H:%M:%S GMT", &tm);
  return buf;
}

std::optional<std::string> bearer_of(const http::RequestHeader& h) {
  if (h.count(bhttp::field::authorization) != 1) return std::nullopt;
  auto v = http::bearer_token(h[bhttp::field::authorization]);
  if (!v || v->empty() || v->size() > 512) return std::nullopt;
  return std::string(*v);
}

// The sink a PUT's body goes into: its Upload's version file.
class UploadSink final : public http::BodySink {
public:
  explicit UploadSink(std::unique_ptr<Upload> u) : m_upload(std::move(u)) {}
  std::optional<Problem> write(const void* data, std::size_t size) override { return m_upload->write(data, size); }
  std::unique_ptr<Upload> take() { return std::move(m_upload); }

private:
  std::unique_ptr<Upload> m_upload;
};

class StoreHandler final : public http::Handler {
public:
  StoreHandler(ObjectStore& store, std::unordered_set<std::string> token_hashes, std::string control_plane,
               const std::string& ca_file)
      : m_store(store), m_tokens(std::move(token_hashes)), m_cp(std::move(control_plane)), m_client(ca_file) {}

  ~StoreHandler() override { shutdown(); }

  /// Stops the worker pool (control-plane checks not started yet are dropped).
  void shutdown() {
    m_work.stop();
    m_work.join();
  }

  http::BodyPlan plan(const http::RequestHeader& h, const http::Peer& peer) override {
    const RouteRow* row = nullptr;
    http::BodyPlan plan = plan_body(h, peer, row);
    // Answered before the body, handle() never sees it: counted here, as handle() counts
    // the others (under the route it matched, in no time worth measuring).
    if (plan.refuse)
      Metrics::global().observe(
          "mep_http_request_duration_seconds",
          fmt::format("route=\"{}\",code=\"{}\"", row ? row->pattern : "unmatched", plan.refuse->status()), 0.0);
    return plan;
  }

  void handle(http::Request&& req, const http::Peer& peer, std::shared_ptr<http::BodySink> sink,
              http::Responder responder) override {
    auto started = std::chrono::steady_clock::now();
    std::vector<std::string> params;
    std::string allow;
    const bhttp::verb method = req.method() == bhttp::verb::head ? bhttp::verb::get : req.method();
    auto target = http::parse_target(req.target());
    const RouteRow* row = target ? http::find_route(k_routes, method, target->segments, params, allow) : nullptr;
    std::string label = row ? std::string(row->pattern) : "unmatched";
    // Every answer goes through here: the metrics, then the session.
    auto finish = [responder, started, label, version = req.version(), keep = req.keep_alive()](auto&& res) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      Metrics::global().observe("mep_http_request_duration_seconds",
                                fmt::format("route=\"{}\",code=\"{}\"", label, res.result_int()), secs);
      res.version(version);
      res.keep_alive(keep && res.keep_alive());
      using Res = std::decay_t<decltype(res)>;
      if constexpr (std::is_same_v<Res, http::FileResponse>)
        responder.send_file(std::forward<decltype(res)>(res));
      else
        responder.send(std::forward<decltype(res)>(res));
    };
    auto fail = [finish](Problem p) {
      if (p.code == Code::stale_fence) Metrics::global().inc("mep_fencing_rejections_total");
      finish(problem(std::move(p)));
    };
    if (!target) return fail(Problem(Code::invalid_request, "malformed request target"));
    if (!row) {
      if (allow.empty()) return fail(Problem(Code::not_found, "no such endpoint"));
      auto res = problem(Problem(Code::method_not_allowed, "this endpoint does not accept that method"));
      res.set(bhttp::field::allow, allow);
      return finish(std::move(res));
    }
    switch (row->route) {
    case Route::health:
      return finish(json_response(bhttp::status::ok, boost::json::object{{"status", "ok"}}));
    case Route::ready: {
      if (m_store.ready()) return finish(json_response(bhttp::status::ok, boost::json::object{{"status", "ok"}}));
      Problem p(Code::unavailable, "the data plane's disk or database is failing (full, read-only, or I/O errors)");
      p.retry_after_s = 1;
      return fail(std::move(p));
    }
    case Route::metrics: {
      // Beyond loopback plan() authenticated the token: against --token-file; with --strict
      // only its presence, so the control plane says whether it has the admin scope.
      auto answer = [finish] {
        http::Response res{bhttp::status::ok, 11};
        common_headers(res);
        res.set(bhttp::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
        res.body() = Metrics::global().render(Metrics::Exporter::store);
        res.prepare_payload();
        finish(std::move(res));
      };
      if (peer.loopback || m_cp.empty()) return answer();
      return net::post(m_work, [this, bearer = bearer_of(req.base()).value_or(""), answer, fail] {
        http::ClientRequest r;
        r.url = m_cp + "/v1/admin/check";
        r.headers = {{"Authorization", "Bearer " + bearer}};
        if (auto p = control_plane_refusal(m_client.perform(r))) return fail(std::move(*p));
        answer();
      });
    }
    case Route::put_object:
      return put(std::move(req), std::static_pointer_cast<UploadSink>(sink), finish, fail);
    case Route::get_object: {
      auto id = Uuid::parse(params[0]);
      if (!id) return fail(Problem(Code::invalid_request, "the memory id in the path must be a UUID"));
      return authorize_read(
          req, id->to_string(),
          [this, finish, fail, memory_id = id->to_string()]() mutable {
            auto obj = m_store.open(memory_id);
            if (!obj) return fail(std::move(obj.error()));
            if (obj->inline_data) {
              http::Response res{bhttp::status::ok, 11};
              common_headers(res);
              object_headers(res, obj->info);
              res.set(bhttp::field::content_type, "application/octet-stream");
              res.body() = std::move(*obj->inline_data);
              res.prepare_payload();
              return finish(std::move(res));
            }
            boost::beast::file f;
            f.native_handle(obj->fd);
            http::FileResponse res{bhttp::status::ok, 11};
            boost::beast::error_code ec;
            res.body().reset(std::move(f), ec);
            if (ec) return fail(disk_problem(ec.value(), "read the object"));
            common_headers(res);
            object_headers(res, obj->info);
            res.set(bhttp::field::content_type, "application/octet-stream");
            res.prepare_payload();
            finish(std::move(res));
          },
          fail);
    }
    case Route::get_fence: {
      auto id = Uuid::parse(params[0]);
      if (!id) return fail(Problem(Code::invalid_request, "the memory id in the path must be a UUID"));
      return authorize_read(
          req, id->to_string(),
          [this, finish, fail, memory_id = id->to_string()]() mutable {
            auto st = m_store.state(memory_id);
            if (!st) return fail(std::move(st.error()));
            boost::json::object o{{"memory_instance_id", memory_id}, {"fencing_token", st->mark}};
            if (st->object)
              o["object"] = object_json(*st->object);
            else
              o["object"] = nullptr;
            finish(json_response(bhttp::status::ok, o));
          },
          fail);
    }
    case Route::advance:
      return advance(std::move(req), finish, fail);
    case Route::none:
      break;
    }
    fail(Problem(Code::not_found, "no such endpoint"));
  }

private:
  // The request's body plan, or its refusal; `row`: the route matched (null: none).
  http::BodyPlan plan_body(const http::RequestHeader& h, const http::Peer& peer, const RouteRow*& row) {
    http::BodyPlan plan;
    plan.limit = k_small_body;
    std::vector<std::string> params;
    row = match(h, params);
    // The token first, unless the endpoint is open: without one, a client learns nothing,
    // not even which endpoints exist (handle() answers 404 and 405 to those with one).
    const RouteRow* open = row ? row : match(h, params, bhttp::verb::get); // 405s of open paths are open
    const bool is_open = open && (open->route == Route::health || open->route == Route::ready ||
                                  (open->route == Route::metrics && peer.loopback));
    if (is_open) return plan;
    if (auto p = authenticate(h)) {
      plan.refuse = std::move(*p);
      return plan;
    }
    if (!row || row->route != Route::put_object) return plan; // handle() answers 404 and 405
    // A PUT: everything that can be checked before the body arrives is.
    auto id = Uuid::parse(params[0]);
    if (!id) return refuse(plan, Problem(Code::invalid_request, "the memory id in the path must be a UUID"));
    auto token = parse_fencing_token(h);
    if (!token) return refuse(plan, std::move(token.error()));
    if (auto pre = parse_preconditions(h); !pre) return refuse(plan, std::move(pre.error()));
    const std::string memory_id = id->to_string();
    if (auto st = m_store.state(memory_id); st && *token < st->mark) return refuse(plan, stale_fence(*token, st->mark));
    auto upload = m_store.begin(memory_id);
    if (!upload) return refuse(plan, std::move(upload.error()));
    plan.limit = m_store.max_object_size();
    plan.sink = std::make_shared<UploadSink>(std::move(*upload));
    return plan;
  }

  // The route of the request, or of its path with `method` instead of its own.
  const RouteRow* match(const http::RequestHeader& h, std::vector<std::string>& params,
                        std::optional<bhttp::verb> method = std::nullopt) const {
    auto target = http::parse_target(h.target());
    if (!target) return nullptr;
    std::string allow;
    if (!method) method = h.method() == bhttp::verb::head ? bhttp::verb::get : h.method();
    return http::find_route(k_routes, *method, target->segments, params, allow);
  }

  static http::BodyPlan& refuse(http::BodyPlan& plan, Problem p) {
    if (p.code == Code::stale_fence) Metrics::global().inc("mep_fencing_rejections_total");
    plan.refuse = std::move(p);
    return plan;
  }

  // Without --strict: the token's SHA-256 must be one of --token-file's. With --strict the
  // control plane decides (per request, in handle); here only its presence is checked.
  std::optional<Problem> authenticate(const http::RequestHeader& h) const {
    auto token = bearer_of(h);
    if (!token) {
      Metrics::global().inc("mep_auth_failures_total");
      return Problem(Code::unauthenticated, "an Authorization: Bearer token is required");
    }
    if (!m_cp.empty()) return std::nullopt;
    if (!m_tokens.count(sha256_hex(*token))) {
      Metrics::global().inc("mep_auth_failures_total");
      return Problem(Code::unauthenticated, "unknown bearer token");
    }
    return std::nullopt;
  }

  template <class Finish, class Fail>
  void put(http::Request&& req, std::shared_ptr<UploadSink> sink, Finish finish, Fail fail) {
    // plan() made the sink and checked the headers; parse them again for the values.
    auto token = parse_fencing_token(req.base());
    auto pre = parse_preconditions(req.base());
    if (!sink || !token || !pre) return fail(Problem(Code::invalid_request, "malformed PUT"));
    auto upload = sink->take();
    const std::string memory_id = upload->memory_id();
    auto commit = [this, finish, fail, token = *token, pre = std::move(*pre)](std::unique_ptr<Upload> u) mutable {
      const std::uint64_t size = u->size();
      m_store.commit(std::move(u), token, std::move(pre), [finish, fail, size](expected<ObjectInfo, Problem> r) {
        if (!r) return fail(std::move(r.error()));
        Metrics::global().inc("mep_store_bytes_written_total", {}, static_cast<double>(size));
        auto res = json_response(bhttp::status::ok, object_json(*r));
        object_headers(res, *r);
        finish(std::move(res));
      });
    };
    if (m_cp.empty()) return commit(std::move(upload));
    // --strict: the control plane must confirm that this token is the live lease's, for
    // this caller's tenant, before the write can become current.
    auto shared_upload = std::make_shared<std::unique_ptr<Upload>>(std::move(upload));
    net::post(m_work, [this, bearer = bearer_of(req.base()).value_or(""), memory_id, token = *token, shared_upload,
                       commit, fail]() mutable {
      if (auto p = verify_with_control_plane(bearer, memory_id, token)) return fail(std::move(*p));
      commit(std::move(*shared_upload));
    });
  }

  template <class Finish, class Fail>
  void advance(http::Request&& req, Finish finish, Fail fail) {
    if (auto p = http::json_body_problem(req.base())) return fail(std::move(*p));
    auto body = json::parse_object(req.body());
    if (!body) return fail(std::move(body.error()));
    json::ObjectReader r(*body);
    auto memory = r.uuid("memory_instance_id", Need::required);
    auto token = r.integer("fencing_token", Need::required, 0, k_max_token);
    if (auto ok = r.finish(); !ok) return fail(std::move(ok.error()));
    auto run = [this, finish, fail, memory = *memory, token = *token] {
      m_store.advance(memory, token, [finish, fail, memory](expected<std::int64_t, Problem> mark) {
        if (!mark) return fail(std::move(mark.error()));
        finish(json_response(bhttp::status::ok,
                             boost::json::object{{"memory_instance_id", memory}, {"fencing_token", *mark}}));
      });
    };
    if (m_cp.empty()) return run();
    net::post(m_work, [this, bearer = bearer_of(req.base()).value_or(""), memory = *memory, token = *token, run, fail] {
      if (auto p = verify_with_control_plane(bearer, memory, token)) return fail(std::move(*p));
      run();
    });
  }

  // Reads need the caller's tenant to own the memory (--strict), else only the token file.
  template <class Then, class Fail>
  void authorize_read(const http::Request& req, std::string memory_id, Then then, Fail fail) {
    if (m_cp.empty()) return then();
    net::post(m_work, [this, bearer = bearer_of(req.base()).value_or(""), memory_id = std::move(memory_id), then,
                       fail]() mutable {
      http::ClientRequest r;
      r.url = m_cp + "/v1/memories/" + memory_id;
      r.headers = {{"Authorization", "Bearer " + bearer}};
      auto res = m_client.perform(r);
      if (auto p = control_plane_refusal(res)) return fail(std::move(*p));
      then();
    });
  }

  std::optional<Problem> verify_with_control_plane(const std::string& bearer, const std::string& memory_id,
                                                   std::int64_t token) {
    http::ClientRequest r;
    r.method = "POST";
    r.url = m_cp + "/v1/fence/verify";
    r.headers = {{"Authorization", "Bearer " + bearer}, {"Content-Type", "application/json"}};
    r.body = json::dump(boost::json::object{{"memory_instance_id", memory_id}, {"fencing_token", token}});
    auto p = control_plane_refusal(m_client.perform(r));
    if (p && p->code == Code::stale_fence) {
      // Shaped as this store's own refusal (SPEC §8): the token presented, and the live one.
      p->extensions["presented_token"] = token;
      if (auto* cur = p->extensions.if_contains("current_fencing_token"); cur && cur->is_int64())
        p->extensions["current_token"] = cur->as_int64();
    }
    return p;
  }

  // The control plane's answer as this store's refusal, or nullopt for a 2xx.
  static std::optional<Problem> control_plane_refusal(const http::ClientResponse& res) {
    if (res.ok()) return std::nullopt;
    if (res.status == 0 || res.status >= 500) {
      Problem p(Code::unavailable, "the control plane could not confirm the token: " +
                                       (res.status ? std::to_string(res.status) : res.error));
      p.retry_after_s = 1;
      return p;
    }
    auto o = json::parse_object(res.body);
    Problem p = o ? Problem::from_json(*o) : Problem(Code::forbidden, "the control plane refused the request");
    p.instance.clear();
    return p;
  }

  template <class Res>
  static void common_headers(Res& res) {
    res.set(bhttp::field::server, k_server_name);
    res.set("X-Request-Id", uuid_v7().to_string());
    res.set(bhttp::field::cache_control, "no-store");
  }

  template <class Res>
  static void object_headers(Res& res, const ObjectInfo& o) {
    res.set("Fencing-Token", std::to_string(o.fencing_token));
    res.set(bhttp::field::etag, "\"" + o.etag + "\"");
    res.set(bhttp::field::last_modified, http_date(o.modified));
  }

  static boost::json::object object_json(const ObjectInfo& o) {
    return boost::json::object{{"memory_instance_id", o.memory_id},
                               {"fencing_token", o.fencing_token},
                               {"etag", o.etag},
                               {"size", o.size},
                               {"last_modified", format_rfc3339_ms(o.modified)}};
  }

  static http::Response json_response(bhttp::status status, const boost::json::object& body) {
    http::Response res{status, 11};
    common_headers(res);
    res.set(bhttp::field::content_type, "application/json");
    res.body() = json::dump(body);
    res.prepare_payload();
    return res;
  }

  static http::Response problem(Problem p) { return http::problem_response(std::move(p), 11, true, k_server_name); }

  ObjectStore& m_store;
  std::unordered_set<std::string> m_tokens;
  std::string m_cp; // the control plane's base URL (--strict), else empty
  http::Client m_client;
  net::thread_pool m_work{8};
};

// The token file: SHA-256 hex digests, one per line; blank lines and # comments ignored.
std::unordered_set<std::string> read_token_hashes(const std::string& path, std::vector<std::string>& errors) {
  std::unordered_set<std::string> out;
  std::ifstream in(path);
  if (!in) {
    errors.push_back("cannot read the token file " + path);
    return out;
  }
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line.front() == '#') continue;
    if (line.size() != 64 || line.find_first_not_of("0123456789abcdef") != std::string::npos) {
      errors.push_back(fmt::format("{}:{}: not a SHA-256 in lower-case hex (make one with 'mep token hash')", path, n));
      continue;
    }
    out.insert(line);
  }
  if (out.empty() && errors.empty()) errors.push_back("the token file " + path + " holds no token hash");
  return out;
}

} // namespace

int run_store(const StoreServerOptions& o) {
  log::set_program("mep store");
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
  const bool tls = !o.tls_cert.empty() || !o.tls_key.empty();
  if (tls && (o.tls_cert.empty() || o.tls_key.empty())) errors.push_back("--tls-cert and --tls-key go together");
  if (endpoint && !endpoint->address().is_loopback() && !tls && !o.insecure_plaintext)
    errors.push_back("refusing to serve plain HTTP on " + o.listen +
                     ", which is not a loopback address: give --tls-cert and --tls-key, or --insecure-plaintext "
                     "if a TLS proxy sits in front");
  std::string cp;
  if (o.strict) {
    if (o.control_plane.empty())
      errors.push_back("--strict needs --control-plane URL");
    else {
      try {
        cp = http::checked_base_url(o.control_plane, "control-plane URL");
      } catch (const std::exception& e) {
        errors.push_back(e.what());
      }
    }
    if (!o.token_file.empty())
      errors.push_back(
          "--strict and --token-file exclude each other: with --strict the control plane checks every token");
    if (!o.ca_file.empty()) {
      try {
        http::checked_ca_file(o.ca_file, "--ca-file");
      } catch (const std::exception& e) {
        errors.push_back(e.what());
      }
    }
  } else if (!o.control_plane.empty()) {
    errors.push_back("--control-plane is used with --strict only");
  } else if (!o.ca_file.empty()) {
    errors.push_back("--ca-file is used with --strict --control-plane only");
  }
  std::unordered_set<std::string> hashes;
  if (!o.strict) {
    if (o.token_file.empty())
      errors.push_back(
          "every request is authenticated: give --token-file FILE (SHA-256 of each accepted token, "
          "one per line: 'mep token new > T; mep token hash < T > FILE'), or --strict --control-plane URL");
    else
      hashes = read_token_hashes(o.token_file, errors);
  }
  if (o.max_object_size == 0) errors.push_back("--max-object-size must be at least 1 byte");
  if (!errors.empty()) {
    for (const auto& e : errors) log::error("{}", e);
    return exit_code::usage;
  }

  // 2. The directory (recovered: uncommitted uploads removed) and the TLS context.
  std::unique_ptr<ObjectStore> store;
  std::unique_ptr<net::ssl::context> tls_ctx;
  try {
    store = std::make_unique<ObjectStore>(o.dir.empty() ? default_store_dir() : o.dir, o.max_object_size);
    if (tls) tls_ctx = http::make_tls_context(o.tls_cert, o.tls_key);
  } catch (const std::exception& e) {
    log::error("{}", e.what());
    return exit_code::other;
  }

  // 3. Bind and serve.
  std::signal(SIGPIPE, SIG_IGN);
  net::io_context ioc(o.threads);
  auto handler = std::make_unique<StoreHandler>(*store, std::move(hashes), cp, o.ca_file);
  http::EdgeOptions edge;
  edge.server_name = std::string(k_server_name);
  std::unique_ptr<http::TcpListener> listener;
  try {
    listener = std::make_unique<http::TcpListener>(ioc, *endpoint, *handler, tls_ctx.get(), edge);
  } catch (const boost::system::system_error& e) {
    log::error("cannot listen on {}: {}", o.listen, e.code().message());
    return exit_code::other;
  }
  listener->start();

  // 4. SIGTERM/SIGINT: stop accepting, let requests in flight finish (at most 30 s: an
  //    upload may be on its way), exit 0.
  net::signal_set signals(ioc, SIGINT, SIGTERM);
  net::steady_timer drain(ioc);
  auto deadline = std::make_shared<std::chrono::steady_clock::time_point>();
  std::function<void()> wait_drain = [&] {
    if (listener->in_flight() == 0 || std::chrono::steady_clock::now() >= *deadline) return ioc.stop();
    drain.expires_after(std::chrono::milliseconds(20));
    drain.async_wait([&](boost::system::error_code) { wait_drain(); });
  };
  signals.async_wait([&](boost::system::error_code ec, int sig) {
    if (ec) return;
    log::info("signal {}: shutting down", sig);
    listener->stop_accepting();
    *deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    wait_drain();
  });
  auto ep = listener->local_endpoint();
  std::string host = ep.address().is_v6() ? "[" + ep.address().to_string() + "]" : ep.address().to_string();
  std::fprintf(stderr, "mep store listening on %s://%s:%u\n", tls ? "https" : "http", host.c_str(),
               static_cast<unsigned>(ep.port()));
  std::fflush(stderr);

  std::vector<std::thread> pool;
  for (int i = 1; i < o.threads; ++i) pool.emplace_back([&] { http::run_io_thread(ioc); });
  http::run_io_thread(ioc);
  for (auto& t : pool) t.join();
  // The handler's workers stop first (they call the store), then the store finishes its
  // queued writes (their answers call the handler), then the handler goes.
  handler->shutdown();
  store.reset();
  handler.reset();
  log::info("stopped");
  return exit_code::ok;
}

} // namespace mep::store
