// JSON-RPC 2.0 and the MCP lifecycle, tools, resources and logging (protocol.hpp).
#include "mep/mcp/protocol.hpp"

#include "mep/json.hpp"

#include <boost/json/parse.hpp>

#include <algorithm>
#include <cctype>
#include <exception>
#include <regex>

namespace mep::mcp {
namespace js = boost::json;

std::string_view negotiate_version(std::string_view requested) {
  for (auto v : k_versions)
    if (v == requested) return v;
  return k_latest_version;
}

namespace {

bool valid_id(const js::value& v) { return v.is_string() || v.is_int64() || v.is_uint64(); }

Incoming invalid(int code, std::string message, js::value id = nullptr) {
  Incoming in;
  in.kind = Incoming::Kind::invalid;
  in.error = RpcError{code, std::move(message), nullptr};
  in.id = std::move(id);
  return in;
}

} // namespace

Incoming decode(std::string_view line) {
  auto parsed = json::parse_object(line, "a JSON-RPC message");
  if (!parsed) {
    // Valid JSON that is not an object (a batch, a number) is an invalid request; anything
    // else cannot be parsed.
    boost::system::error_code ec;
    auto v = js::parse(line, ec);
    if (!ec && v.is_array())
      return invalid(rpc::invalid_request, "batches are not supported: send one JSON-RPC message per line");
    if (!ec && v.is_object()) return invalid(rpc::invalid_request, parsed.error().detail); // a key twice, too deep
    if (!ec) return invalid(rpc::invalid_request, "a JSON-RPC message is a JSON object");
    return invalid(rpc::parse_error, "Parse error: " + parsed.error().detail);
  }
  js::object& o = *parsed;
  js::value id = nullptr;
  const bool has_id = o.contains("id");
  if (has_id) {
    if (!valid_id(o.at("id"))) return invalid(rpc::invalid_request, "\"id\" must be a string or an integer");
    id = o.at("id");
  }
  auto* version = o.if_contains("jsonrpc");
  if (!version || !version->is_string() || version->get_string() != "2.0")
    return invalid(rpc::invalid_request, "\"jsonrpc\" must be \"2.0\"", id);
  if (o.contains("result") || o.contains("error")) {
    Incoming in;
    in.kind = Incoming::Kind::response;
    in.id = std::move(id);
    return in;
  }
  auto* method = o.if_contains("method");
  if (!method || !method->is_string()) return invalid(rpc::invalid_request, "\"method\" must be a string", id);
  Incoming in;
  in.kind = has_id ? Incoming::Kind::request : Incoming::Kind::notification;
  in.id = std::move(id);
  in.method = std::string(method->get_string());
  if (auto* p = o.if_contains("params")) {
    if (!p->is_object()) {
      if (!has_id) return in; // a notification with bad params: nothing to answer
      return invalid(rpc::invalid_params, "\"params\" must be an object", in.id);
    }
    in.params = std::move(p->get_object());
  }
  return in;
}

js::value id_of_oversized(std::string_view head, std::string_view tail) {
  static const std::regex first(
      R"re(^\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?[0-9]{1,18}|"[^"\\]{0,200}")\s*[,}])re");
  static const std::regex last(R"re("id"\s*:\s*(-?[0-9]{1,18}|"[^"\\]{0,200}")\s*\}\s*$)re");
  std::match_results<std::string_view::const_iterator> m;
  // Only a member of the message itself: the last one is followed by the message's own
  // closing brace alone (a nested object's "id" would be followed by two).
  if (std::regex_search(head.begin(), head.end(), m, first) || std::regex_search(tail.begin(), tail.end(), m, last)) {
    std::string text = m[1].str();
    if (text.front() == '"') return js::value(text.substr(1, text.size() - 2));
    return js::value(std::stoll(text));
  }
  return nullptr;
}

std::string encode_result(const js::value& id, js::value result) {
  return json::dump(js::object{{"jsonrpc", "2.0"}, {"id", id}, {"result", std::move(result)}});
}

std::string encode_error(const js::value& id, const RpcError& e) {
  js::object err{{"code", e.code}, {"message", e.message}};
  if (!e.data.is_null()) err["data"] = e.data;
  js::object o{{"jsonrpc", "2.0"}};
  if (!id.is_null()) o["id"] = id; // the SDK refuses "id": null
  o["error"] = std::move(err);
  return json::dump(o);
}

std::string encode_notification(std::string_view method, std::optional<js::object> params) {
  js::object o{{"jsonrpc", "2.0"}, {"method", method}};
  if (params) o["params"] = std::move(*params);
  return json::dump(o);
}

ToolResult ToolResult::ok(js::object structured, std::string text) {
  ToolResult r;
  r.structured = std::move(structured);
  r.text = std::move(text);
  return r;
}

ToolResult ToolResult::error(std::string message) {
  ToolResult r;
  r.is_error = true;
  r.structured = js::object{{"error", message}};
  r.text = std::move(message);
  return r;
}

Server::Server(Info info, std::vector<Tool> tools, Resources* resources, std::function<void(const std::string&)> send)
    : m_info(std::move(info)), m_tools(std::move(tools)), m_resources(resources), m_send(std::move(send)) {}

bool Server::initialized() const {
  std::lock_guard lock(m_mutex);
  return m_initialized;
}

void Server::send(const std::string& message) {
  std::lock_guard lock(m_mutex);
  m_send(message);
}

void Server::notify(std::string_view method, std::optional<js::object> params) {
  if (!initialized()) return;
  send(encode_notification(method, std::move(params)));
}

void Server::log(std::string_view level, js::value data) {
  const auto at = std::find(k_levels.begin(), k_levels.end(), level);
  const auto rank = static_cast<std::size_t>(at - k_levels.begin());
  {
    std::lock_guard lock(m_mutex);
    if (!m_initialized || rank < m_level) return;
  }
  send(encode_notification("notifications/message",
                           js::object{{"level", level}, {"logger", "mep"}, {"data", std::move(data)}}));
}

void Server::handle(std::string_view line) {
  Incoming in;
  try {
    in = decode(line);
  } catch (const std::exception& e) {
    in = invalid(rpc::internal_error, std::string("internal error: ") + e.what());
  }
  switch (in.kind) {
  case Incoming::Kind::response:
    return; // this server sends no requests: an answer to none is ignored
  case Incoming::Kind::invalid:
    send(encode_error(in.id, in.error));
    return;
  case Incoming::Kind::notification:
    if (in.method == "notifications/initialized") {
      std::lock_guard lock(m_mutex);
      m_initialized = true;
    }
    return; // others (cancelled, roots/list_changed): nothing to do, nothing to answer
  case Incoming::Kind::request:
    break;
  }
  std::string reply;
  try {
    auto r = dispatch(in);
    reply = r ? encode_result(in.id, std::move(*r)) : encode_error(in.id, r.error());
  } catch (const std::exception& e) {
    reply = encode_error(in.id, RpcError{rpc::internal_error, std::string("internal error: ") + e.what(), nullptr});
  }
  if (reply.size() > k_max_reply)
    reply = encode_error(in.id, RpcError{rpc::internal_error,
                                         "the answer is larger than " + std::to_string(k_max_reply >> 20) +
                                             " MiB once encoded: ask for less (memory_read's length)",
                                         nullptr});
  send(reply);
}

void Server::handle_oversized(std::string_view head, std::string_view tail) {
  send(
      encode_error(id_of_oversized(head, tail),
                   RpcError{rpc::invalid_request,
                            "message larger than " + std::to_string(k_max_message >> 20) + " MiB: not read", nullptr}));
}

expected<js::value, RpcError> Server::dispatch(const Incoming& in) {
  const std::string& m = in.method;
  if (m == "ping") return js::object{};
  if (m == "initialize") return initialize(in.params);
  // The lifecycle: nothing but ping before initialize (an error, not silence: a client that
  // probes with another method falls back at once).
  if (!initialized())
    return make_unexpected(RpcError{rpc::invalid_request, "not initialized: send initialize first", nullptr});
  if (m == "tools/list") return list_tools(in.params);
  if (m == "tools/call") return call_tool(in.params);
  if (m == "logging/setLevel") {
    auto* level = in.params.if_contains("level");
    const auto at = level && level->is_string()
                        ? std::find(k_levels.begin(), k_levels.end(), std::string_view(level->get_string()))
                        : k_levels.end();
    if (at == k_levels.end())
      return make_unexpected(RpcError{rpc::invalid_params,
                                      "level must be one of debug, info, notice, warning, error, "
                                      "critical, alert, emergency",
                                      nullptr});
    std::lock_guard lock(m_mutex);
    m_level = static_cast<std::size_t>(at - k_levels.begin());
    return js::object{};
  }
  if (m_resources && m.rfind("resources/", 0) == 0) {
    if (m == "resources/list") return js::object{{"resources", m_resources->list()}};
    if (m == "resources/templates/list") return js::object{{"resourceTemplates", js::array{}}};
    auto* uri = in.params.if_contains("uri");
    if (!uri || !uri->is_string())
      return make_unexpected(RpcError{rpc::invalid_params, "params.uri must be a string", nullptr});
    const std::string u(uri->get_string());
    if (m == "resources/read") {
      auto r = m_resources->read(u);
      if (!r) return make_unexpected(std::move(r.error()));
      return std::move(*r);
    }
    if (m == "resources/subscribe" || m == "resources/unsubscribe") {
      auto r = m == "resources/subscribe" ? m_resources->subscribe(u) : m_resources->unsubscribe(u);
      if (!r) return make_unexpected(std::move(r.error()));
      return js::object{};
    }
  }
  return make_unexpected(RpcError{rpc::method_not_found, "Method not found: " + m, nullptr});
}

expected<js::value, RpcError> Server::initialize(const js::object& params) {
  if (initialized()) return make_unexpected(RpcError{rpc::invalid_request, "already initialized", nullptr});
  auto* requested = params.if_contains("protocolVersion");
  if (!requested || !requested->is_string())
    return make_unexpected(RpcError{rpc::invalid_params, "params.protocolVersion must be a string", nullptr});
  js::object capabilities{{"tools", js::object{{"listChanged", false}}}, {"logging", js::object{}}};
  if (m_resources) capabilities["resources"] = js::object{{"subscribe", true}, {"listChanged", true}};
  js::object info{{"name", m_info.name}, {"version", m_info.version}};
  if (!m_info.title.empty()) info["title"] = m_info.title;
  js::object result{{"protocolVersion", negotiate_version(requested->get_string())},
                    {"capabilities", std::move(capabilities)},
                    {"serverInfo", std::move(info)}};
  if (!m_info.instructions.empty()) result["instructions"] = m_info.instructions;
  std::lock_guard lock(m_mutex);
  m_initialized = true; // notifications may go from here on (the client's initialized follows)
  return result;
}

expected<js::value, RpcError> Server::list_tools(const js::object&) {
  js::array tools;
  for (const auto& t : m_tools) {
    js::object o{{"name", t.name}};
    if (!t.title.empty()) o["title"] = t.title;
    if (!t.description.empty()) o["description"] = t.description;
    o["inputSchema"] = t.input_schema;
    if (!t.output_schema.empty()) o["outputSchema"] = t.output_schema;
    if (!t.annotations.empty()) o["annotations"] = t.annotations;
    tools.emplace_back(std::move(o));
  }
  return js::object{{"tools", std::move(tools)}};
}

expected<js::value, RpcError> Server::call_tool(const js::object& params) {
  auto* name = params.if_contains("name");
  if (!name || !name->is_string())
    return make_unexpected(RpcError{rpc::invalid_params, "params.name must be a tool's name", nullptr});
  const auto tool = std::find_if(m_tools.begin(), m_tools.end(),
                                 [&](const Tool& t) { return t.name == std::string_view(name->get_string()); });
  if (tool == m_tools.end())
    return make_unexpected(RpcError{rpc::invalid_params, "Unknown tool: " + std::string(name->get_string()), nullptr});
  js::object arguments;
  if (auto* a = params.if_contains("arguments")) {
    if (!a->is_object())
      return make_unexpected(RpcError{rpc::invalid_params, "params.arguments must be an object", nullptr});
    arguments = a->get_object();
  }
  ToolResult r;
  try {
    r = tool->call(arguments);
  } catch (const std::exception& e) {
    r = ToolResult::error(std::string("internal error: ") + e.what());
  }
  std::string text = r.text.empty() ? json::dump(r.structured) : r.text;
  js::object result{{"content", js::array{js::object{{"type", "text"}, {"text", std::move(text)}}}}};
  // With an output schema, structured content must match it: an error carries none.
  if (!r.is_error || tool->output_schema.empty()) result["structuredContent"] = std::move(r.structured);
  if (r.is_error) result["isError"] = true;
  return result;
}

} // namespace mep::mcp
