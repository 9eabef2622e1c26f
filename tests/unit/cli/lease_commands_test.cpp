// The lease commands of `mep` (cli/cmd_lease.cpp) against a fake daemon client that answers
// with mepd's recorded answers (tests/contract/daemon_api.json, which the handler's own test
// holds mepd to): what each command sends, prints and exits with, without a daemon.
#include "commands.hpp"
#include "daemon_client.hpp"

#include "mep/json.hpp"
#include "mep/problem.hpp"

#include <CLI/CLI.hpp>
#include <boost/json/serialize.hpp>
#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

using namespace mep;
using namespace mep::cli;

namespace {

// Answers each route with its recorded answer, or what a test put in its place; records
// every request.
class ReplayingDaemon final : public DaemonClient {
public:
  struct Sent {
    std::string method, target, body;
  };
  std::vector<Sent> sent;
  std::map<std::string, DaemonReply> overrides; // "GET /v1/leases" → the answer instead

  ReplayingDaemon() {
    std::ifstream in(std::string(MEP_SOURCE_DIR) + "/tests/contract/daemon_api.json");
    REQUIRE(in);
    std::stringstream text;
    text << in.rdbuf();
    auto doc = json::parse_object(text.str());
    REQUIRE(doc);
    for (const auto& v : doc->at("exchanges").as_array()) {
      const auto& e = v.as_object();
      DaemonReply r;
      r.status = static_cast<int>(e.at("status").as_int64());
      if (!e.at("response").is_null()) r.body = boost::json::serialize(e.at("response"));
      m_recorded[std::string(e.at("route").as_string())] = r;
    }
  }

  DaemonReply request(const std::string&, const std::string& method, const std::string& target, const std::string& body,
                      int, Cancel*) override {
    sent.push_back({method, target, body});
    const std::string path = target.substr(0, target.find('?'));
    const std::string route =
        method + " " + (path.rfind("/v1/leases/", 0) == 0 ? std::string("/v1/leases/{name}") : path);
    if (auto it = overrides.find(route); it != overrides.end()) return it->second;
    if (auto it = m_recorded.find(route); it != m_recorded.end()) return it->second;
    DaemonReply none;
    none.status = 404;
    none.body = json::dump(Problem(Code::not_found, "no route " + route).to_json());
    return none;
  }

  boost::json::object last_body() const {
    REQUIRE(!sent.empty());
    auto o = json::parse_object(sent.back().body);
    REQUIRE(o);
    return *o;
  }

private:
  std::map<std::string, DaemonReply> m_recorded;
};

struct Ran {
  int status = -1;
  std::string out, err;
};

std::string slurp(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) s.append(buf, n);
  return s;
}

// `mep --socket /fake.sock ARGS…` with the lease commands only, stdout and stderr captured.
Ran mep_cli(ReplayingDaemon& daemon, std::vector<std::string> args) {
  CLI::App app{"mep", "mep"};
  GlobalOptions g;
  app.add_flag("--json", g.json);
  app.add_option("--socket", g.socket);
  Action action;
  register_lease_commands(app, g, action);
  args.insert(args.begin(), {"mep", "--socket", "/nonexistent/mepd.sock"});
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(static_cast<int>(argv.size()), argv.data());
  REQUIRE(action);

  ScopedDaemonClient fake(daemon);
  Ran ran;
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  std::fflush(stdout);
  std::fflush(stderr);
  const int saved_out = ::dup(1), saved_err = ::dup(2);
  ::dup2(::fileno(out), 1);
  ::dup2(::fileno(err), 2);
  try {
    ran.status = action();
  } catch (...) {
    ran.status = -2;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  ::dup2(saved_out, 1);
  ::dup2(saved_err, 2);
  ::close(saved_out);
  ::close(saved_err);
  ran.out = slurp(out);
  ran.err = slurp(err);
  std::fclose(out);
  std::fclose(err);
  return ran;
}

constexpr const char* k_memory = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";

} // namespace

TEST_CASE("mep status prints mepd's leases as a table", "[cli]") {
  ReplayingDaemon daemon;
  auto r = mep_cli(daemon, {"status"});
  CHECK(r.status == exit_code::ok);
  CHECK(r.err.empty());
  CHECK(r.out.rfind("NAME", 0) == 0);
  CHECK(r.out.find(std::string("\na                         ") + k_memory + "       3  expired     held") !=
        std::string::npos);
  CHECK(r.out.find(std::string("\nb                         ") + k_memory) != std::string::npos);
  REQUIRE(daemon.sent.size() == 1);
  CHECK(daemon.sent[0].method == "GET");
  CHECK(daemon.sent[0].target == "/v1/leases");
}

TEST_CASE("mep claim sends a typed attach, labels sorted, and prints the grant", "[cli]") {
  ReplayingDaemon daemon;
  auto r = mep_cli(daemon, {"claim", "contractagent", "/srv/agents/agent.uai", "--label", "team=b", "--label",
                            "role=builder", "--max-hold", "3600"});
  CHECK(r.status == exit_code::ok);
  CHECK(r.out == std::string("claimed contractagent  memory=") + k_memory + "  token=3  expires in expired\n");
  const auto body = daemon.last_body();
  CHECK(json::dump(body) == R"({"name":"contractagent","path":"/srv/agents/agent.uai","ttl_seconds":30,"bind":"none",)"
                            R"("labels":{"role":"builder","team":"b"},"max_hold_seconds":3600})");
}

TEST_CASE("mep sync, fetch, init, branch and identify print what mepd answered", "[cli]") {
  ReplayingDaemon daemon;
  auto s = mep_cli(daemon, {"sync", "contractagent"});
  CHECK(s.status == exit_code::ok);
  CHECK(s.out == std::string("synced contractagent  memory=") + k_memory + "  token=3  size=12  etag=\"e1\"\n");
  auto f = mep_cli(daemon, {"fetch", k_memory, "/srv/agents/fetched.uai"});
  CHECK(f.status == exit_code::ok);
  CHECK(f.out == std::string("fetched /srv/agents/fetched.uai  memory=") + k_memory + "  token=3  size=12\n");
  auto i = mep_cli(daemon, {"init", "/srv/agents/new.uai"});
  CHECK(i.out == std::string("created /srv/agents/new.uai  memory=") + k_memory + "\n");
  auto b = mep_cli(daemon, {"branch", "/srv/agents/agent.uai", "/srv/agents/child.uai"});
  CHECK(b.out == std::string("branched /srv/agents/child.uai  memory=0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c  parent=") +
                     k_memory + "  at token 7\n");
  auto d = mep_cli(daemon, {"identify", "/srv/agents/agent.uai"});
  CHECK(d.out == std::string("/srv/agents/agent.uai  memory=") + k_memory + "  parent=-\n");
  CHECK(daemon.sent[3].target == "/v1/branch");
  CHECK(daemon.sent[4].target == "/v1/identify?path=/srv/agents/agent.uai");
}

TEST_CASE("mep --json prints mepd's answer as it came", "[cli]") {
  ReplayingDaemon daemon;
  daemon.overrides["GET /v1/leases"] = DaemonReply{200, R"({"leases":[],"extra":1})", {}, false};
  auto r = mep_cli(daemon, {"--json", "status"});
  CHECK(r.status == exit_code::ok);
  CHECK(r.out == "{\"leases\":[],\"extra\":1}\n");
}

TEST_CASE("an answer mep cannot read, a refusal and no daemon: one line each, and their exit codes", "[cli]") {
  ReplayingDaemon daemon;
  daemon.overrides["GET /v1/leases"] = DaemonReply{200, R"({"leases":[{"canonical_name":7}]})", {}, false};
  auto odd = mep_cli(daemon, {"status"});
  CHECK(odd.status == exit_code::other);
  CHECK(odd.out.empty());
  CHECK(odd.err.find("GET /v1/leases") != std::string::npos);
  CHECK(std::count(odd.err.begin(), odd.err.end(), '\n') == 1);

  Problem held(Code::name_held, "held by another owner");
  daemon.overrides["POST /v1/attach"] = DaemonReply{423, json::dump(held.to_json()), {}, false};
  auto refused = mep_cli(daemon, {"claim", "contractagent", "/srv/agents/agent.uai"});
  CHECK(refused.status == exit_code::held);
  CHECK(refused.out.empty());
  CHECK(refused.err == "mep: Name held: held by another owner\n");

  daemon.overrides["POST /v1/sync"] = DaemonReply{0, {}, "No such file or directory", false};
  auto gone = mep_cli(daemon, {"sync", "contractagent"});
  CHECK(gone.status == exit_code::unavailable);
  CHECK(gone.err.find("cannot reach mepd") != std::string::npos);
}

TEST_CASE("mep decides on the kind of mepd's refusal, not on its status", "[cli]") {
  auto reply = [](int status, const Problem& p) { return DaemonReply{status, json::dump(p.to_json()), {}, false}; };
  // The kind comes from the code the answer carries, whatever its status says.
  CHECK(reply(423, Problem(Code::memory_attached, "x")).held());
  CHECK(reply(503, Problem(Code::name_held, "x")).held());
  CHECK_FALSE(reply(423, Problem(Code::unavailable, "x")).held());
  CHECK(reply(503, Problem(Code::control_plane_unreachable, "x")).refusal() == Kind::unreachable);
  CHECK(reply(429, Problem(Code::rate_limited, "x")).refusal() == Kind::retry);
  CHECK(reply(410, Problem(Code::lease_expired, "x")).refusal() == Kind::gone);
  // An answer that is not a problem document is mepd's fault; 2xx and no answer are no refusal.
  CHECK(DaemonReply{500, "<html>", {}, false}.refusal() == Kind::internal);
  CHECK_FALSE(DaemonReply{201, "{}", {}, false}.refusal());
  CHECK_FALSE(DaemonReply{0, {}, "Connection refused", false}.refusal());
  CHECK_FALSE(DaemonReply{0, {}, "Connection refused", false}.reached());
}
