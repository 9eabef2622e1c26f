// mepd's socket API as a recorded contract: one request per route, answered by the real
// request handler (daemon_handler.cpp) on the fake service, and the event lines the keeper
// writes, held to tests/contract/daemon_api.json. The Python and TypeScript SDKs' suites
// decode the same recorded answers with their own types (clients/*/tests: contract), so a
// field renamed or retyped on either side fails a suite instead of reaching an agent.
//
// After an intended change to the API, record the file again and review its diff:
//   MEP_RECORD_CONTRACT=1 build/tests/unit/unit_daemon "[contract]"
#include "../../support/fake_daemon_service.hpp"
#include "mep/daemon_api.hpp"
#include "mep/daemon_api/types.hpp"
#include "mep/daemon_handler.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"

#include <boost/json/serialize.hpp>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unistd.h>

using mep::daemon::DaemonHandler;
using mep::test::FakeDaemonService;
namespace bhttp = boost::beast::http;
namespace json = boost::json;

namespace {

const std::string k_contract = std::string(MEP_SOURCE_DIR) + "/tests/contract/daemon_api.json";

// Routes with no JSON exchange to record: the event stream (its lines are recorded as
// "events"), the Prometheus text and the health document (its members are the keeper's, and
// the integration suites read them from a running mepd).
const std::set<std::string> k_unrecorded = {"GET /v1/events", "GET /metrics", "GET /healthz"};

struct Exchange {
  std::string name;
  std::string route; // the handler's pattern: "GET /v1/leases/{name}"
  bhttp::verb method;
  std::string target;
  json::value request; // null: no body
};

// One request per route; paths are absolute (the peer's working directory is not read).
std::vector<Exchange> exchanges() {
  const std::string dir = "/srv/agents/";
  const std::string memory = FakeDaemonService::k_memory;
  return {
      {"attach", "POST /v1/attach", bhttp::verb::post, "/v1/attach",
       json::object{{"name", "contractagent"}, {"path", dir + "agent.uai"}, {"ttl_seconds", 30}}},
      {"detach", "POST /v1/detach", bhttp::verb::post, "/v1/detach", json::object{{"name", "contractagent"}}},
      {"leases", "GET /v1/leases", bhttp::verb::get, "/v1/leases", nullptr},
      {"lease", "GET /v1/leases/{name}", bhttp::verb::get, "/v1/leases/contractagent", nullptr},
      {"branch", "POST /v1/branch", bhttp::verb::post, "/v1/branch",
       json::object{{"path", dir + "agent.uai"}, {"new_path", dir + "child.uai"}}},
      {"init", "POST /v1/init", bhttp::verb::post, "/v1/init", json::object{{"path", dir + "new.uai"}}},
      {"lineage", "GET /v1/lineage", bhttp::verb::get, "/v1/lineage?path=%2Fsrv%2Fagents%2Fagent.uai", nullptr},
      {"identify", "GET /v1/identify", bhttp::verb::get, "/v1/identify?path=%2Fsrv%2Fagents%2Fagent.uai", nullptr},
      {"verify", "POST /v1/verify", bhttp::verb::post, "/v1/verify", json::object{{"name", "contractagent"}}},
      {"sync", "POST /v1/sync", bhttp::verb::post, "/v1/sync", json::object{{"name", "contractagent"}}},
      {"fetch", "POST /v1/fetch", bhttp::verb::post, "/v1/fetch",
       json::object{{"memory_instance_id", memory}, {"path", dir + "fetched.uai"}}},
  };
}

mep::http::Peer own_peer() {
  mep::http::Peer p;
  p.unix_socket = p.loopback = p.cred_known = true;
  p.uid = ::geteuid();
  p.gid = ::getegid();
  p.pid = 0;
  return p;
}

// What the handler answers each exchange, and the keeper's event lines for a lease that
// is granted, renewed, degraded, lost and released, as recorded.
json::object record() {
  FakeDaemonService service;
  DaemonHandler handler(service, [](const mep::http::Peer&) { return true; });
  json::array out;
  for (const auto& e : exchanges()) {
    mep::http::Request req{e.method, e.target, 11};
    req.set(bhttp::field::host, "localhost");
    if (!e.request.is_null()) {
      req.set(bhttp::field::content_type, "application/json");
      req.body() = json::serialize(e.request);
    }
    req.prepare_payload();
    auto res = handler.respond(req, own_peer(), -1);
    json::value body = nullptr;
    if (!res.body().empty()) body = *mep::json::parse_object(res.body());
    out.push_back(json::object{{"name", e.name},
                               {"route", e.route},
                               {"target", e.target},
                               {"request", e.request},
                               {"status", static_cast<std::int64_t>(res.result_int())},
                               {"response", body}});
  }
  mep::daemon::Held h;
  h.canonical_name = "contractagent";
  h.display_name = "Contract Agent";
  h.memory_id = FakeDaemonService::k_memory;
  h.lease_id = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a60";
  h.fencing_token = 3;
  h.ttl_s = 30;
  h.expires_at = FakeDaemonService::k_expires;
  json::array events;
  const mep::UnixMs at = FakeDaemonService::k_expires - 20000;
  for (const auto& [kind, state, reason] : std::vector<std::tuple<std::string, mep::daemon::LeaseState, std::string>>{
           {"granted", mep::daemon::LeaseState::held, ""},
           {"renewed", mep::daemon::LeaseState::held, ""},
           {"degraded", mep::daemon::LeaseState::degraded, "unreachable"},
           {"lost", mep::daemon::LeaseState::lost, "deadline"},
           {"released", mep::daemon::LeaseState::held, ""}}) {
    h.state = state;
    events.push_back(mep::daemon::api::to_json(mep::daemon::Event{kind, h, reason}, at));
  }
  return json::object{{"about", "mepd's socket API: requests and the handler's recorded answers "
                                "(tests/unit/daemon/daemon_api_contract_test.cpp records them)"},
                      {"exchanges", out},
                      {"events", events}};
}

// The recorded file, parsed (the test fails when it is missing or not a JSON object).
std::optional<json::object> read_contract() {
  std::ifstream in(k_contract);
  REQUIRE(in);
  std::stringstream text;
  text << in.rdbuf();
  auto recorded = mep::json::parse_object(text.str());
  REQUIRE(recorded);
  return std::optional<json::object>(std::move(*recorded));
}

// Pretty enough to review as a diff: one member per line at the top two levels.
std::string pretty(const json::object& doc) {
  std::ostringstream s;
  s << "{\n  \"about\": " << json::serialize(doc.at("about")) << ",\n  \"exchanges\": [\n";
  const auto& ex = doc.at("exchanges").as_array();
  for (std::size_t i = 0; i < ex.size(); ++i)
    s << "    " << json::serialize(ex[i]) << (i + 1 < ex.size() ? ",\n" : "\n");
  s << "  ],\n  \"events\": [\n";
  const auto& ev = doc.at("events").as_array();
  for (std::size_t i = 0; i < ev.size(); ++i)
    s << "    " << json::serialize(ev[i]) << (i + 1 < ev.size() ? ",\n" : "\n");
  s << "  ]\n}\n";
  return s.str();
}

} // namespace

TEST_CASE("daemon API contract: every route has a recorded exchange", "[contract]") {
  std::set<std::string> recorded;
  for (const auto& e : exchanges()) recorded.insert(e.route);
  for (const auto& route : DaemonHandler::route_names()) {
    INFO(route);
    CHECK((recorded.count(route) == 1 || k_unrecorded.count(route) == 1));
  }
  const auto served = DaemonHandler::route_names();
  for (const auto& route : recorded) {
    INFO(route);
    CHECK(std::find(served.begin(), served.end(), route) != served.end());
  }
}

TEST_CASE("daemon API contract: the handler serves the API's route table, each endpoint once", "[contract]") {
  // mepd's routing is built from the table; what could still go wrong is the table itself:
  // a method Beast does not know (its row would never match), or an endpoint twice.
  namespace api = mep::daemon_api;
  std::vector<std::string> table;
  std::set<api::Endpoint> endpoints;
  for (const auto& r : api::k_routes) {
    table.push_back(std::string(r.method) + " " + std::string(r.pattern));
    CHECK(endpoints.insert(r.endpoint).second);
    CHECK(&api::route_of(r.endpoint) == &r);
  }
  CHECK(DaemonHandler::route_names() == table);
  CHECK(api::target(api::Endpoint::identify, "path=%2Fa").target == "/v1/identify?path=%2Fa");
  CHECK(api::target(api::Endpoint::detach).method == "POST");
  CHECK(api::query_value("/a b/\xC3\xA9~&=") == "/a%20b/%C3%A9~%26%3D");
}

TEST_CASE("daemon API contract: the API's decoders read every recorded answer back to the same JSON", "[contract]") {
  // What the CLI reads is what mepd writes: decode, encode again, compare.
  namespace api = mep::daemon_api;
  const auto recorded = read_contract();
  auto again = [](const json::object& answer, auto decode, auto encode) {
    auto v = decode(answer);
    if (!v) FAIL(v.error().detail);
    return json::serialize(encode(*v)) == json::serialize(answer);
  };
  for (const auto& ex : recorded->at("exchanges").as_array()) {
    const std::string name(ex.at("name").as_string());
    INFO(name);
    if (name == "detach") continue; // 204: no body
    const auto& a = ex.at("response").as_object();
    auto lease = [](const api::Lease& l) { return api::to_json(l); };
    auto plain = [](const auto& v) { return api::to_json(v); };
    if (name == "attach" || name == "lease")
      CHECK(again(a, api::decode_lease, lease));
    else if (name == "leases")
      CHECK(again(a, api::decode_lease_list, [](const std::vector<api::Lease>& ls) {
        json::array arr;
        for (const auto& l : ls) arr.push_back(api::to_json(l));
        return json::object{{"leases", arr}};
      }));
    else if (name == "branch")
      CHECK(again(a, api::decode_branched_file, plain));
    else if (name == "init")
      CHECK(again(a, api::decode_initialized, plain));
    else if (name == "identify")
      CHECK(again(a, api::decode_identified, plain));
    else if (name == "verify")
      CHECK(again(a, api::decode_verified_lease, plain));
    else if (name == "sync")
      CHECK(again(a, api::decode_synced, api::to_json_sync));
    else if (name == "fetch")
      CHECK(again(a, api::decode_fetched, api::to_json_fetch));
    else if (name == "lineage")
      CHECK(again(a, mep::lease::wire::decode_lineage,
                  [](const mep::lease::Lineage& l) { return mep::lease::wire::to_json(l); }));
    else
      FAIL("a recorded exchange with no decoder here: " << name);
  }
  for (const auto& line : recorded->at("events").as_array())
    CHECK(again(line.as_object(), api::decode_event_line, [](const api::EventLine& e) { return api::to_json(e); }));
  // And a wrong member is a problem naming it, not a default.
  json::object bad = recorded->at("exchanges").as_array()[0].at("response").as_object();
  bad["fencing_token"] = "3";
  auto refused = api::decode_lease(bad);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().detail.find("fencing_token") != std::string::npos);
  bad.erase("fencing_token");
  bad.erase("canonical_name");
  refused = api::decode_lease(bad);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().detail.find("canonical_name") != std::string::npos);
}

TEST_CASE("daemon API contract: every recorded request passes the API's strict decoders, and they refuse strays",
          "[contract]") {
  namespace api = mep::daemon_api;
  for (const auto& e : exchanges()) {
    INFO(e.name);
    if (e.request.is_null()) continue;
    const auto& o = e.request.as_object();
    bool ok = false;
    if (e.name == "attach")
      ok = api::decode_attach_body(o).has_value();
    else if (e.name == "detach" || e.name == "verify" || e.name == "sync")
      ok = api::decode_lease_named(o).has_value();
    else if (e.name == "branch" || e.name == "init")
      ok = api::decode_path_body(o, e.name == "branch").has_value();
    else if (e.name == "fetch")
      ok = api::decode_fetch_body(o).has_value();
    else
      FAIL("a recorded request with no decoder here: " << e.name);
    CHECK(ok);
  }
  // What the CLI encodes, mepd decodes to the same request.
  api::AttachBody a;
  a.name = "Contract Agent";
  a.path = "/srv/agents/agent.uai";
  a.ttl_s = 60;
  a.bind_pid = false;
  a.wait_s = 12;
  a.labels = {{"role", "builder"}, {"team", "a"}};
  a.exe = "python3";
  a.max_hold_s = 3600;
  auto back = api::decode_attach_body(api::to_json(a));
  REQUIRE(back);
  CHECK(back->name == a.name);
  CHECK(back->path == a.path);
  CHECK(back->ttl_s == a.ttl_s);
  CHECK(back->bind_pid == a.bind_pid);
  CHECK(back->wait_s == a.wait_s);
  CHECK(back->labels == a.labels);
  CHECK(back->exe == a.exe);
  CHECK(back->max_hold_s == a.max_hold_s);
  // Strict: an unknown member, a wrong type, a bad bind, each named.
  auto stray = api::decode_lease_named(json::object{{"name", "a"}, {"leaseid", "x"}});
  REQUIRE_FALSE(stray);
  CHECK(stray.error().code == mep::Code::invalid_request);
  CHECK(stray.error().detail.find("leaseid") != std::string::npos);
  auto bind = api::decode_attach_body(json::object{{"name", "a"}, {"path", "/p"}, {"bind", "process"}});
  REQUIRE_FALSE(bind);
  CHECK(bind.error().detail.find("bind") != std::string::npos);
  auto id = api::decode_fetch_body(json::object{{"memory_instance_id", "not-a-uuid"}, {"path", "/p"}});
  REQUIRE_FALSE(id);
  CHECK(id.error().detail.find("memory_instance_id") != std::string::npos);
}

TEST_CASE("daemon API contract: the handler answers as recorded", "[contract]") {
  const json::object now = record();
  if (std::getenv("MEP_RECORD_CONTRACT")) {
    std::ofstream(k_contract) << pretty(now);
    WARN("recorded " << k_contract);
    return;
  }
  const auto recorded = read_contract();
  const auto& want = recorded->at("exchanges").as_array();
  const auto& got = now.at("exchanges").as_array();
  REQUIRE(want.size() == got.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("exchange " << json::serialize(got[i].at("name"))
                     << " (record again after an intended change: see the "
                        "top of this file)");
    CHECK(json::serialize(got[i]) == json::serialize(want[i]));
  }
  CHECK(json::serialize(now.at("events")) == json::serialize(recorded->at("events")));
  // Every answer of a success is an object the SDKs can decode; none is a problem.
  for (const auto& e : got) {
    INFO(json::serialize(e.at("name")));
    CHECK(e.at("status").as_int64() < 300);
  }
}
