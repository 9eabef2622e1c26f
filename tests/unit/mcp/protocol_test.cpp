// JSON-RPC decoding, the MCP lifecycle and the tool and resource methods, without I/O.
#include "mep/mcp/protocol.hpp"

#include <boost/json/parse.hpp>
#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace js = boost::json;
using namespace mep::mcp;

namespace {

struct Fixture {
  std::vector<std::string> sent;
  int calls = 0;
  Server server{Server::Info{"mep", "", "1.0", "use it"}, tools(), nullptr,
                [this](const std::string& m) { sent.push_back(m); }};

  std::vector<Tool> tools() {
    Tool echo{"echo",
              "",
              "echoes",
              js::object{{"type", "object"}},
              js::object{{"type", "object"}},
              {},
              [this](const js::object& a) {
                ++calls;
                if (a.contains("fail")) return ToolResult::error("it failed");
                if (a.contains("throw")) throw std::runtime_error("boom");
                return ToolResult::ok(js::object{{"got", a}});
              }};
    return {echo};
  }
  js::object last() {
    REQUIRE_FALSE(sent.empty());
    return js::parse(sent.back()).as_object();
  }
  js::object request(const std::string& line) {
    const auto before = sent.size();
    server.handle(line);
    REQUIRE(sent.size() == before + 1);
    return last();
  }
  void initialize(const char* version = "2025-11-25") {
    request(std::string(R"({"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":")") + version +
            R"(","capabilities":{},"clientInfo":{"name":"t","version":"1"}}})");
    server.handle(R"({"jsonrpc":"2.0","method":"notifications/initialized"})");
  }
};

} // namespace

TEST_CASE("mcp_negotiates_a_known_revision_else_the_latest", "[mcp]") {
  REQUIRE(negotiate_version("2025-06-18") == "2025-06-18");
  REQUIRE(negotiate_version("2024-11-05") == "2024-11-05");
  REQUIRE(negotiate_version("2099-01-01") == "2025-11-25");
  REQUIRE(negotiate_version("") == "2025-11-25");
}

TEST_CASE("mcp_initialize_answers_capabilities_and_echoes_the_revision", "[mcp]") {
  Fixture f;
  auto r = f.request(
      R"({"jsonrpc":"2.0","id":"a","method":"initialize","params":{"protocolVersion":"2025-03-26","capabilities":{},"clientInfo":{"name":"t","version":"1"}}})");
  REQUIRE(r.at("id") == "a");
  auto& result = r.at("result").as_object();
  REQUIRE(result.at("protocolVersion") == "2025-03-26");
  REQUIRE(result.at("serverInfo").at("name") == "mep");
  REQUIRE(result.at("instructions") == "use it");
  REQUIRE(result.at("capabilities").as_object().contains("tools"));
  REQUIRE_FALSE(result.at("capabilities").as_object().contains("resources")); // none given
  REQUIRE_FALSE(r.contains("error"));
  // A second initialize is refused.
  auto again = f.request(R"({"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26"}})");
  REQUIRE(again.at("error").at("code") == rpc::invalid_request);
}

TEST_CASE("mcp_before_initialize_only_ping_is_served", "[mcp]") {
  Fixture f;
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":1,"method":"ping"})").at("result").as_object().empty());
  auto r = f.request(R"({"jsonrpc":"2.0","id":2,"method":"tools/list"})");
  REQUIRE(r.at("error").at("code") == rpc::invalid_request);
  // No notification goes out before initialize.
  f.server.log("error", js::value("x"));
  REQUIRE(f.sent.size() == 2);
}

TEST_CASE("mcp_bad_messages_get_json_rpc_errors", "[mcp]") {
  Fixture f;
  f.initialize();
  auto parse = f.request("{not json");
  REQUIRE(parse.at("error").at("code") == rpc::parse_error);
  REQUIRE_FALSE(parse.contains("id")); // never "id": null
  REQUIRE(f.request("[1,2]").at("error").at("code") == rpc::invalid_request);
  REQUIRE(f.request("42").at("error").at("code") == rpc::invalid_request);
  auto no_version = f.request(R"({"id":7,"method":"ping"})");
  REQUIRE(no_version.at("error").at("code") == rpc::invalid_request);
  REQUIRE(no_version.at("id") == 7);
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":null,"method":"ping"})").at("error").at("code") == rpc::invalid_request);
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":8,"method":"nope"})").at("error").at("code") == rpc::method_not_found);
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":9,"method":"ping","params":[1]})").at("error").at("code") ==
          rpc::invalid_params);
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":9,"method":"ping","id":10})").at("error").at("code") ==
          rpc::invalid_request); // a key twice is refused
  // Notifications and responses get no answer, known or not.
  const auto before = f.sent.size();
  f.server.handle(R"({"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":3}})");
  f.server.handle(R"({"jsonrpc":"2.0","method":"whatever"})");
  f.server.handle(R"({"jsonrpc":"2.0","id":5,"result":{}})");
  REQUIRE(f.sent.size() == before);
  // And the server goes on.
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":11,"method":"ping"})").at("result").as_object().empty());
}

TEST_CASE("mcp_tools_call_reports_failures_as_results", "[mcp]") {
  Fixture f;
  f.initialize();
  auto list = f.request(R"({"jsonrpc":"2.0","id":1,"method":"tools/list"})");
  auto& tools = list.at("result").at("tools").as_array();
  REQUIRE(tools.size() == 1);
  REQUIRE(tools[0].at("inputSchema").at("type") == "object");
  REQUIRE_FALSE(list.at("result").as_object().contains("nextCursor"));

  auto ok = f.request(R"({"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"echo","arguments":{"x":1}}})");
  REQUIRE(ok.at("result").at("structuredContent").at("got").at("x") == 1);
  REQUIRE(ok.at("result").at("content").at(0).at("type") == "text");
  REQUIRE_FALSE(ok.at("result").as_object().contains("isError"));

  auto failed =
      f.request(R"({"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"fail":1}}})");
  REQUIRE(failed.at("result").at("isError") == true);
  REQUIRE(failed.at("result").at("content").at(0).at("text") == "it failed");
  // With an output schema, an error carries no structured content (it would not match).
  REQUIRE_FALSE(failed.at("result").as_object().contains("structuredContent"));

  auto thrown =
      f.request(R"({"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"echo","arguments":{"throw":1}}})");
  REQUIRE(thrown.at("result").at("isError") == true);

  REQUIRE(
      f.request(R"({"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"nope"}})").at("error").at("code") ==
      rpc::invalid_params);
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":6,"method":"tools/call","params":{"name":"echo","arguments":[]}})")
              .at("error")
              .at("code") == rpc::invalid_params);
  REQUIRE(f.calls == 3);
}

TEST_CASE("mcp_log_level_filters_notifications", "[mcp]") {
  Fixture f;
  f.initialize();
  const auto before = f.sent.size();
  f.server.log("debug", js::value("hidden by default"));
  f.server.log("notice", js::value("shown"));
  REQUIRE(f.sent.size() == before + 1);
  REQUIRE(f.last().at("method") == "notifications/message");
  REQUIRE(f.last().at("params").at("level") == "notice");
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":1,"method":"logging/setLevel","params":{"level":"error"}})")
              .at("result")
              .as_object()
              .empty());
  const auto after = f.sent.size();
  f.server.log("warning", js::value("below error"));
  REQUIRE(f.sent.size() == after);
  REQUIRE(f.request(R"({"jsonrpc":"2.0","id":2,"method":"logging/setLevel","params":{"level":"loud"}})")
              .at("error")
              .at("code") == rpc::invalid_params);
}

TEST_CASE("mcp_oversized_message_is_answered_with_its_id", "[mcp]") {
  // The official SDK writes the id last; other clients first.
  REQUIRE(id_of_oversized(R"({"method":"tools/call","params":{"arguments":{"text":"aaaa)",
                          R"(aaaa"}},"jsonrpc":"2.0","id":17})") == 17);
  REQUIRE(id_of_oversized(R"({"jsonrpc":"2.0","id":"x-1","method":"tools/call","params":{)", "}}}") == "x-1");
  // An "id" inside the params is not the message's.
  REQUIRE(id_of_oversized(R"({"method":"m","params":{"a":"b)", R"(b","id":3}})").is_null());
  Fixture f;
  f.initialize();
  f.server.handle_oversized(R"({"jsonrpc":"2.0","method":"tools/call",)", R"(,"id":4})");
  REQUIRE(f.last().at("id") == 4);
  REQUIRE(f.last().at("error").at("code") == rpc::invalid_request);
}
