// Cloud Spanner's REST API (see rest.hpp).
#include "mep/spanner/rest.hpp"

#include "mep/json.hpp"
#include "mep/time.hpp"

#include <boost/json/parse.hpp>
#include <boost/json/serialize.hpp>
#include <fmt/format.h>

#include <charconv>
#include <thread>

namespace mep::server::spanner {
namespace json = boost::json;

namespace {

std::string_view code_name(int code) {
  static constexpr std::string_view names[] = {
      "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
      "DATA_LOSS", "UNAUTHENTICATED"};
  return code >= 0 && code < static_cast<int>(std::size(names)) ? names[code] : "UNKNOWN";
}

int code_of_status(std::string_view status) {
  for (int c = 0; c <= 16; ++c)
    if (code_name(c) == status) return c;
  return 2;
}

// "0.171s" (a google.protobuf.Duration in JSON) as milliseconds.
std::optional<std::chrono::milliseconds> duration_of(std::string_view text) {
  if (text.empty() || text.back() != 's') return std::nullopt;
  text.remove_suffix(1);
  double secs = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), secs);
  if (ec != std::errc() || end != text.data() + text.size() || secs < 0 || secs > 3600) return std::nullopt;
  return std::chrono::milliseconds(static_cast<std::int64_t>(secs * 1000));
}

Failure failure_of(int grpc_code, int http_status, std::string_view message) {
  switch (grpc_code) {
  case 10:
    return Failure::aborted;
  case 5:
    return Failure::not_found;
  case 6:
    return Failure::already_exists;
  case 9:
    return Failure::failed_precondition;
  case 3:
  case 11:
  case 12:
    return Failure::invalid;
  case 14:
  case 8:
    return Failure::unavailable;
  case 4:
  case 1:
    return Failure::deadline;
  case 16:
    return Failure::unauthenticated;
  case 7:
    return Failure::permission;
  case 13:
    // The emulator's gateway answers NOT_FOUND (a deleted session, an unknown database) as
    // 500 with code 13: it cannot marshal the ResourceInfo detail.
    if (http_status == 500 && message.find("failed to marshal error message") != std::string_view::npos)
      return Failure::not_found;
    return Failure::internal;
  default:
    return http_status == 503 ? Failure::unavailable : Failure::internal;
  }
}

} // namespace

std::string RpcError::describe() const {
  if (kind == Failure::transport) return "no answer: " + message;
  return fmt::format("{} ({}): {}", code_name(grpc_code), http_status, message);
}

RpcError classify_error(const http::ClientResponse& res) {
  RpcError e;
  e.http_status = res.status;
  if (res.status == 0) {
    e.kind = Failure::transport;
    e.message = res.error;
    return e;
  }
  e.grpc_code = 2;
  e.message = res.body.substr(0, 500);
  boost::system::error_code ec;
  json::value v = json::parse(res.body, ec);
  if (!ec && v.is_object()) {
    const json::object* o = &v.get_object();
    // Google's REST errors: {"error": {code (HTTP), message, status, details}}; the
    // emulator's gateway: {code (gRPC), message}.
    if (auto* inner = o->if_contains("error"); inner && inner->is_object()) {
      o = &inner->get_object();
      if (auto* s = o->if_contains("status"); s && s->is_string()) e.grpc_code = code_of_status(s->get_string());
    } else if (auto* c = o->if_contains("code"); c && c->is_int64()) {
      e.grpc_code = static_cast<int>(c->get_int64());
    }
    if (auto* m = o->if_contains("message"); m && m->is_string()) e.message = std::string(m->get_string());
    if (auto* d = o->if_contains("details"); d && d->is_array())
      for (const auto& detail : d->get_array())
        if (detail.is_object())
          if (auto* delay = detail.get_object().if_contains("retryDelay"); delay && delay->is_string())
            e.retry_delay = duration_of(delay->get_string());
  } else if (res.status == 503 || res.status == 502 || res.status == 504) {
    e.grpc_code = 14;
  } else if (res.status == 401) {
    e.grpc_code = 16;
  } else if (res.status == 403) {
    e.grpc_code = 7;
  } else if (res.status == 404) {
    e.grpc_code = 5;
  }
  e.kind = failure_of(e.grpc_code, e.http_status, e.message);
  return e;
}

// ---- calls --------------------------------------------------------------------------------------

Rest::Rest(std::string endpoint, std::string database, Transport& transport, TokenSource& tokens)
    : m_endpoint(std::move(endpoint)), m_database(std::move(database)), m_transport(transport), m_tokens(tokens) {
  while (!m_endpoint.empty() && m_endpoint.back() == '/') m_endpoint.pop_back();
}

Rpc<json::object> Rest::call(std::string_view method, const std::string& path, const json::object* body,
                             std::chrono::milliseconds timeout) {
  auto token = m_tokens.token();
  if (!token) return make_unexpected(std::move(token.error()));
  http::ClientRequest req;
  req.method = std::string(method);
  req.url = m_endpoint + "/v1/" + path;
  if (*token) req.headers.emplace_back("Authorization", "Bearer " + **token);
  if (body) {
    req.headers.emplace_back("Content-Type", "application/json");
    req.body = json::serialize(*body);
  }
  req.timeout = timeout;
  req.connect_timeout = std::min<std::chrono::milliseconds>(timeout, std::chrono::milliseconds(3000));
  http::ClientResponse res = m_transport.perform(req);
  if (!res.ok()) return make_unexpected(classify_error(res));
  if (res.body.empty()) return json::object{};
  boost::system::error_code ec;
  json::value v = json::parse(res.body, ec);
  if (ec || !v.is_object()) {
    RpcError e;
    e.kind = Failure::internal;
    e.http_status = res.status;
    e.message = "Spanner answered something that is not a JSON object";
    return make_unexpected(std::move(e));
  }
  return std::move(v.get_object());
}

Rpc<std::string> Rest::create_session() {
  json::object body{{"session", json::object{{"labels", json::object{{"app", "mep"}}}}}};
  auto r = call("POST", m_database + "/sessions", &body, std::chrono::seconds(10));
  if (!r) return make_unexpected(std::move(r.error()));
  auto* name = r->if_contains("name");
  if (!name || !name->is_string()) {
    RpcError e;
    e.message = "createSession answered no session name";
    return make_unexpected(std::move(e));
  }
  return std::string(name->get_string());
}

Rpc<void> Rest::delete_session(const std::string& session) {
  auto r = call("DELETE", session, nullptr, std::chrono::seconds(5));
  if (!r) return make_unexpected(std::move(r.error()));
  return {};
}

Rpc<json::object> Rest::execute_sql(const std::string& session, const json::object& body,
                                    std::chrono::milliseconds timeout) {
  return call("POST", session + ":executeSql", &body, timeout);
}

Rpc<json::object> Rest::read(const std::string& session, const json::object& body, std::chrono::milliseconds timeout) {
  return call("POST", session + ":read", &body, timeout);
}

Rpc<json::object> Rest::commit(const std::string& session, const json::object& body,
                               std::chrono::milliseconds timeout) {
  return call("POST", session + ":commit", &body, timeout);
}

Rpc<void> Rest::rollback(const std::string& session, const std::string& transaction_id) {
  json::object body{{"transactionId", transaction_id}};
  auto r = call("POST", session + ":rollback", &body, std::chrono::seconds(5));
  if (!r) return make_unexpected(std::move(r.error()));
  return {};
}

Rpc<std::vector<std::string>> Rest::get_ddl() {
  auto r = call("GET", m_database + "/ddl", nullptr, std::chrono::seconds(30));
  if (!r) return make_unexpected(std::move(r.error()));
  std::vector<std::string> out;
  if (auto* s = r->if_contains("statements"); s && s->is_array())
    for (const auto& v : s->get_array())
      if (v.is_string()) out.emplace_back(v.get_string());
  return out;
}

Rpc<void> Rest::update_ddl(const std::vector<std::string>& statements, std::chrono::seconds timeout) {
  json::array list;
  for (const auto& st : statements) list.emplace_back(st);
  json::object body{{"statements", std::move(list)}};
  auto op = call("PATCH", m_database + "/ddl", &body, std::chrono::seconds(60));
  if (!op) return make_unexpected(std::move(op.error()));
  // A long-running operation: poll it until done.
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  json::object status = std::move(*op);
  for (auto delay = std::chrono::milliseconds(50);;) {
    if (auto* done = status.if_contains("done"); done && done->is_bool() && done->get_bool()) break;
    auto* name = status.if_contains("name");
    if (!name || !name->is_string()) {
      RpcError e;
      e.message = "updateDdl answered no operation name";
      return make_unexpected(std::move(e));
    }
    if (std::chrono::steady_clock::now() > give_up) {
      RpcError e;
      e.kind = Failure::deadline;
      e.grpc_code = 4;
      e.message = "the schema change did not finish in time";
      return make_unexpected(std::move(e));
    }
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::milliseconds(1000));
    auto next = call("GET", std::string(name->get_string()), nullptr, std::chrono::seconds(30));
    if (!next) return make_unexpected(std::move(next.error()));
    status = std::move(*next);
  }
  if (auto* err = status.if_contains("error"); err && err->is_object()) {
    RpcError e;
    const json::object& o = err->get_object();
    if (auto* c = o.if_contains("code"); c && c->is_int64()) e.grpc_code = static_cast<int>(c->get_int64());
    if (auto* m = o.if_contains("message"); m && m->is_string()) e.message = std::string(m->get_string());
    e.kind = failure_of(e.grpc_code, 0, e.message);
    return make_unexpected(std::move(e));
  }
  return {};
}

// ---- values ---------------------------------------------------------------------------------------

Params& Params::str(const std::string& name, std::string_view v) {
  m_params[name] = v;
  m_types[name] = json::object{{"code", "STRING"}};
  return *this;
}

Params& Params::opt_str(const std::string& name, const std::optional<std::string>& v) {
  m_params[name] = v ? json::value(*v) : json::value(nullptr);
  m_types[name] = json::object{{"code", "STRING"}};
  return *this;
}

Params& Params::int64(const std::string& name, std::int64_t v) {
  m_params[name] = std::to_string(v);
  m_types[name] = json::object{{"code", "INT64"}};
  return *this;
}

Params& Params::opt_int64(const std::string& name, const std::optional<std::int64_t>& v) {
  m_params[name] = v ? json::value(std::to_string(*v)) : json::value(nullptr);
  m_types[name] = json::object{{"code", "INT64"}};
  return *this;
}

Params& Params::boolean(const std::string& name, bool v) {
  m_params[name] = v;
  m_types[name] = json::object{{"code", "BOOL"}};
  return *this;
}

Params& Params::timestamp(const std::string& name, const std::optional<std::string>& v) {
  m_params[name] = v ? json::value(*v) : json::value(nullptr);
  m_types[name] = json::object{{"code", "TIMESTAMP"}};
  return *this;
}

Params& Params::str_array(const std::string& name, const std::vector<std::string>& v) {
  json::array a;
  for (const auto& s : v) a.emplace_back(s);
  m_params[name] = std::move(a);
  m_types[name] = json::object{{"code", "ARRAY"}, {"arrayElementType", json::object{{"code", "STRING"}}}};
  return *this;
}

void Params::add_to(json::object& body) const {
  if (m_params.empty()) return;
  body["params"] = m_params;
  body["paramTypes"] = m_types;
}

json::value int64_value(std::int64_t v) { return json::value(std::to_string(v)); }
json::value opt_int64_value(const std::optional<std::int64_t>& v) { return v ? int64_value(*v) : json::value(nullptr); }
json::value opt_str_value(const std::optional<std::string>& v) { return v ? json::value(*v) : json::value(nullptr); }

Mutations& Mutations::write(std::string_view op, std::string_view table, std::vector<std::string_view> columns,
                            json::array values) {
  json::array cols;
  for (auto c : columns) cols.emplace_back(c);
  json::array rows;
  rows.emplace_back(std::move(values));
  m_list.emplace_back(
      json::object{{op, json::object{{"table", table}, {"columns", std::move(cols)}, {"values", std::move(rows)}}}});
  return *this;
}

Mutations& Mutations::remove(std::string_view table, std::vector<json::array> keys) {
  if (keys.empty()) return *this;
  json::array list;
  for (auto& k : keys) list.emplace_back(std::move(k));
  m_list.emplace_back(
      json::object{{"delete", json::object{{"table", table}, {"keySet", json::object{{"keys", std::move(list)}}}}}});
  return *this;
}

bool Row::is_null(std::size_t i) const { return i >= m_v.size() || m_v[i].is_null(); }

std::string Row::str(std::size_t i) const {
  if (i < m_v.size() && m_v[i].is_string()) return std::string(m_v[i].get_string());
  return {};
}

std::optional<std::string> Row::opt_str(std::size_t i) const {
  if (is_null(i)) return std::nullopt;
  return str(i);
}

std::int64_t Row::int64(std::size_t i) const {
  if (i >= m_v.size()) return 0;
  const auto& v = m_v[i];
  if (v.is_int64()) return v.get_int64();
  if (v.is_string()) {
    std::int64_t out = 0;
    const auto s = v.get_string();
    std::from_chars(s.data(), s.data() + s.size(), out);
    return out;
  }
  return 0;
}

std::optional<std::int64_t> Row::opt_int64(std::size_t i) const {
  if (is_null(i)) return std::nullopt;
  return int64(i);
}

bool Row::boolean(std::size_t i) const { return i < m_v.size() && m_v[i].is_bool() && m_v[i].get_bool(); }

std::vector<Row> Row::rows(std::size_t i) const {
  std::vector<Row> out;
  if (i < m_v.size() && m_v[i].is_array())
    for (const auto& r : m_v[i].get_array())
      if (r.is_array()) out.emplace_back(r.get_array());
  return out;
}

std::vector<Row> rows_of(const json::object& result) {
  std::vector<Row> out;
  if (auto* rows = result.if_contains("rows"); rows && rows->is_array())
    for (const auto& r : rows->get_array())
      if (r.is_array()) out.emplace_back(r.get_array());
  return out;
}

std::optional<std::int64_t> timestamp_micros(std::string_view ts) {
  // 2026-12-06T19:49:48.04691Z
  if (ts.size() < 20 || ts.back() != 'Z') return std::nullopt;
  auto ms = parse_rfc3339(std::string(ts.substr(0, 19)) + "Z");
  if (!ms) return std::nullopt;
  std::int64_t micros = *ms * 1000;
  std::string_view frac = ts.substr(19, ts.size() - 20);
  if (!frac.empty()) {
    if (frac.front() != '.' || frac.size() < 2 || frac.size() > 10) return std::nullopt;
    frac.remove_prefix(1);
    std::int64_t scale = 100'000;
    for (std::size_t i = 0; i < frac.size(); ++i) {
      if (frac[i] < '0' || frac[i] > '9') return std::nullopt;
      if (i < 6) {
        micros += (frac[i] - '0') * scale;
        scale /= 10;
      }
    }
  }
  return micros;
}

} // namespace mep::server::spanner
