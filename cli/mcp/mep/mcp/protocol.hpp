// The Model Context Protocol as `mep mcp` speaks it: JSON-RPC 2.0 messages, one per line
// (the stdio transport), the lifecycle (initialize, ping), tools, resources and logging.
// No I/O here: the edge (cli/cmd_mcp.cpp) reads lines, hands them to Server::handle, and
// writes what `send` is given. Revisions 2025-11-25, 2025-06-18, 2025-03-26 and 2024-11-05,
// negotiated as the specification says (the requested one when known, else the latest).
#pragma once
#include "mep/expected.hpp"

#include <boost/json/object.hpp>
#include <boost/json/value.hpp>

#include <array>
#include <cstddef>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mep::mcp {

/// JSON-RPC error codes (and MCP's resource-not-found).
namespace rpc {
inline constexpr int parse_error = -32700;
inline constexpr int invalid_request = -32600;
inline constexpr int method_not_found = -32601;
inline constexpr int invalid_params = -32602;
inline constexpr int internal_error = -32603;
inline constexpr int resource_not_found = -32002;
} // namespace rpc

/// The longest message read: a longer line is answered with invalid-request, not read. The
/// official SDK's transport buffers at most 10 MiB, so an answer is kept under k_max_reply.
inline constexpr std::size_t k_max_message = 16u << 20;
inline constexpr std::size_t k_max_reply = 8u << 20;

inline constexpr std::string_view k_latest_version = "2025-11-25";
inline constexpr std::array<std::string_view, 4> k_versions = {"2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"};
/// The revision to answer an initialize that asks for `requested`.
std::string_view negotiate_version(std::string_view requested);

struct RpcError {
  int code = rpc::internal_error;
  std::string message;
  boost::json::value data = nullptr; ///< left out when null
};

/// One message from the client, decoded.
struct Incoming {
  enum class Kind { request, notification, response, invalid };
  Kind kind = Kind::invalid;
  boost::json::value id = nullptr; ///< request, response; an invalid message's when it could be read
  std::string method;
  boost::json::object params; ///< absent params read as {}
  RpcError error;             ///< invalid: what to answer
};
Incoming decode(std::string_view line);

/// The id of an oversized message, when it can be read from its first or last bytes without
/// parsing it (a top-level "id" member first, or last as the official SDK writes it).
boost::json::value id_of_oversized(std::string_view head, std::string_view tail);

std::string encode_result(const boost::json::value& id, boost::json::value result);
/// `id` null: the error goes without one (the message's id could not be read).
std::string encode_error(const boost::json::value& id, const RpcError& e);
std::string encode_notification(std::string_view method, std::optional<boost::json::object> params = std::nullopt);

/// What a tool answers: structuredContent and its text, or an error for the model to read.
struct ToolResult {
  boost::json::object structured; ///< sent as structuredContent (and as the text when `text` is empty)
  std::string text;               ///< a text of its own; else the structured content's JSON
  bool is_error = false;

  static ToolResult ok(boost::json::object structured, std::string text = {});
  /// isError with `message` as its text (and {"error": message} as structured content).
  static ToolResult error(std::string message);
};

struct Tool {
  std::string name, title, description;
  boost::json::object input_schema;  ///< JSON Schema, type object
  boost::json::object output_schema; ///< empty: none
  boost::json::object annotations;   ///< readOnlyHint etc.; empty: none
  std::function<ToolResult(const boost::json::object& arguments)> call;
};

/// The resources a server offers (mep mcp: its memory).
class Resources {
public:
  virtual ~Resources() = default;
  /// resources/list's items.
  virtual boost::json::array list() = 0;
  /// resources/read's result ({contents: [...]}), or resource-not-found.
  virtual expected<boost::json::object, RpcError> read(const std::string& uri) = 0;
  virtual expected<void, RpcError> subscribe(const std::string& uri) = 0;
  virtual expected<void, RpcError> unsubscribe(const std::string& uri) = 0;
};

/// The log levels of RFC 5424, as MCP names them, least severe first.
inline constexpr std::array<std::string_view, 8> k_levels = {"debug", "info",     "notice", "warning",
                                                             "error", "critical", "alert",  "emergency"};

/// One MCP session: answers each line, in order. handle() runs on one thread; notify() and
/// log() may be called from any (`send` is called under a mutex).
class Server {
public:
  struct Info {
    std::string name, title, version, instructions;
  };
  Server(Info info, std::vector<Tool> tools, Resources* resources, std::function<void(const std::string&)> send);

  /// Handles one line (without its newline): sends the answer to a request, none to a
  /// notification or a response. Never throws.
  void handle(std::string_view line);
  /// Answers a line longer than k_max_message: `head` and `tail` are its first and last bytes.
  void handle_oversized(std::string_view head, std::string_view tail);

  /// Sends a notification (dropped before the client's initialize).
  void notify(std::string_view method, std::optional<boost::json::object> params = std::nullopt);
  /// notifications/message, when `level` is at or above the client's logging/setLevel
  /// (default: info).
  void log(std::string_view level, boost::json::value data);
  bool initialized() const;

private:
  expected<boost::json::value, RpcError> dispatch(const Incoming& in);
  expected<boost::json::value, RpcError> initialize(const boost::json::object& params);
  expected<boost::json::value, RpcError> list_tools(const boost::json::object& params);
  expected<boost::json::value, RpcError> call_tool(const boost::json::object& params);
  void send(const std::string& message);

  Info m_info;
  std::vector<Tool> m_tools;
  Resources* m_resources;
  std::function<void(const std::string&)> m_send;
  mutable std::mutex m_mutex; // m_send, m_initialized, m_level
  bool m_initialized = false;
  std::size_t m_level = 1; // info
};

} // namespace mep::mcp
