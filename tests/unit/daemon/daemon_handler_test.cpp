// mepd's socket API from a parsed request to its answer (daemon/mep/daemon_handler.hpp), on
// a fake DaemonService: decoding (strict JSON, paths, the fields' rules), routing (404,
// 405 with Allow), encoding (JSON, 204, problem+json) and the exception boundary.
#include "../../support/fake_daemon_service.hpp"
#include "mep/client_process.hpp"
#include "mep/daemon_handler.hpp"
#include "mep/json.hpp"

#include <catch2/catch.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

using mep::daemon::DaemonHandler;
using mep::test::FakeDaemonService;
namespace bhttp = boost::beast::http;

namespace {

mep::http::Peer own_peer() {
  mep::http::Peer p;
  p.unix_socket = p.loopback = p.cred_known = true;
  p.uid = ::geteuid();
  p.gid = ::getegid();
  p.pid = 0; // no working directory to resolve a relative path against
  return p;
}

mep::http::Response call(DaemonHandler& h, bhttp::verb method, const std::string& target,
                         const std::string& body = {}) {
  mep::http::Request req{method, target, 11};
  req.set(bhttp::field::host, "localhost");
  if (!body.empty()) {
    req.set(bhttp::field::content_type, "application/json");
    req.body() = body;
  }
  req.prepare_payload();
  return h.respond(req, own_peer(), -1);
}

boost::json::object body_of(const mep::http::Response& res) {
  auto o = mep::json::parse_object(res.body());
  REQUIRE(o);
  return *o;
}

void require_problem(const mep::http::Response& res, int status, const std::string& code) {
  REQUIRE(res.result_int() == static_cast<unsigned>(status));
  REQUIRE(res[bhttp::field::content_type] == "application/problem+json");
  auto p = body_of(res);
  REQUIRE(p.at("status").as_int64() == status);
  REQUIRE(p.at("code").as_string() == code);
  REQUIRE(p.at("instance").as_string() == res["X-Request-Id"]);
}

} // namespace

TEST_CASE("daemon handler: a file mepd creates for a client gets the client's umask, only from its own process",
          "[daemon_handler]") {
  using mep::daemon::client_file_mode;
  auto of = [](const char* text, uid_t uid) {
    std::istringstream status(text);
    return client_file_mode(status, uid);
  };
  const char* s = "Name:\tpython3\nUmask:\t0027\nState:\tS (sleeping)\nUid:\t1000\t1001\t1001\t1001\n";
  CHECK(of(s, 1001) == 0640);
  // The pid is another user's process (the client exited, its pid was reused): not its umask.
  CHECK(of(s, 1000) == 0600);
  CHECK(of(s, 0) == 0600);
  CHECK(of("Umask:\t0002\n", 1001) == 0600);                 // no Uid line
  CHECK(of("Uid:\t1001\t1001\t1001\t1001\n", 1001) == 0600); // no Umask line (before Linux 4.7)
  CHECK(of("", 1001) == 0600);
  // This process, read from /proc.
  const mode_t mask = ::umask(0022);
  ::umask(mask);
  CHECK(client_file_mode(::getpid(), ::geteuid()) == (0666 & ~mask));
  CHECK(client_file_mode(::getpid(), ::geteuid() + 1) == 0600);
  if (::geteuid() == 0) { // a process of another user, as a reused pid would be
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      ::umask(0);
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(1);
      ::pause();
      ::_exit(0);
    }
    bool switched = false;
    for (int i = 0; i < 500 && !switched; ++i) {
      std::ifstream st("/proc/" + std::to_string(child) + "/status");
      for (std::string line; std::getline(st, line);)
        if (line.rfind("Uid:", 0) == 0 && line.find("65534") != std::string::npos) switched = true;
      if (!switched) ::usleep(10000);
    }
    CHECK(switched);
    CHECK(client_file_mode(child, 0) == 0600);
    CHECK(client_file_mode(child, 65534) == 0666);
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
}

TEST_CASE("daemon handler: '..' in a path is the kernel's, after a symbolic link too", "[daemon_handler]") {
  // L -> A/B: for the kernel L/.. is A, not the directory holding L.
  char tmpl[] = "/tmp/mep-dotdot-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::filesystem::path dir = std::filesystem::canonical(tmpl);
  std::filesystem::create_directories(dir / "A" / "B");
  std::filesystem::create_directory_symlink(dir / "A" / "B", dir / "L");
  FakeDaemonService svc;
  DaemonHandler h(svc, [](const mep::http::Peer&) { return true; });
  const std::string through_link = (dir / "L" / ".." / "t.uai").string();
  auto res = call(h, bhttp::verb::post, "/v1/attach", R"({"name":"a","path":")" + through_link + R"("})");
  REQUIRE(res.result_int() == 201);
  REQUIRE(svc.calls.at(0).attach.path == dir / "A" / "t.uai");
  // A directory that does not exist cannot be resolved: 400, and the service never sees it.
  const std::string nowhere = (dir / "nowhere" / ".." / "t.uai").string();
  require_problem(call(h, bhttp::verb::post, "/v1/attach", R"({"name":"b","path":")" + nowhere + R"("})"), 400,
                  "invalid-request");
  REQUIRE(svc.calls.size() == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("daemon handler: an attach reaches the service decoded, with its path made normal", "[daemon_handler]") {
  FakeDaemonService svc;
  DaemonHandler h(svc, [](const mep::http::Peer&) { return true; });
  auto res = call(h, bhttp::verb::post, "/v1/attach",
                  R"({"name":"Alpha","path":"/tmp/./mem.uai","ttl_seconds":12,"bind":"none","wait_seconds":5})");
  REQUIRE(res.result_int() == 201);
  REQUIRE(svc.calls.size() == 1);
  const auto& a = svc.calls[0].attach;
  REQUIRE(a.name == "Alpha");
  REQUIRE(a.path == "/tmp/mem.uai");
  REQUIRE(a.ttl_s == 12);
  REQUIRE_FALSE(a.bind_pid);
  REQUIRE(a.wait == std::chrono::seconds(5));
  REQUIRE(a.uid == ::geteuid());
  REQUIRE(a.cancelled);
  REQUIRE_FALSE(a.cancelled()); // no socket to have closed, the handler is not stopping
  auto b = body_of(res);
  REQUIRE(b.at("path").as_string() == "/tmp/mem.uai");
  REQUIRE(b.at("fencing_token").as_int64() == 3);
  REQUIRE(b.contains("granted_after_ms"));
  REQUIRE(res[bhttp::field::content_type] == "application/json");

  // The defaults: bound to the caller, the default TTL, no wait.
  svc.calls.clear();
  REQUIRE(call(h, bhttp::verb::post, "/v1/attach", R"({"name":"b","path":"/m.uai"})").result_int() == 201);
  REQUIRE(svc.calls.at(0).attach.bind_pid);
  REQUIRE(svc.calls.at(0).attach.ttl_s == mep::lease::k_default_ttl_s);
  REQUIRE(svc.calls.at(0).attach.wait == std::chrono::seconds(0));
}

TEST_CASE("daemon handler: bad requests are 400 problems and never reach the service", "[daemon_handler]") {
  FakeDaemonService svc;
  DaemonHandler h(svc, [](const mep::http::Peer&) { return true; });
  const char* bodies[] = {
      R"({"name":"a","path":"mem.uai"})",                  // relative, and no working directory to read
      "{\"name\":\"a\",\"path\":\"/tmp/a\\u0000b.uai\"}",  // a NUL would cut the path short
      R"({"name":"a","path":""})",                         // empty
      R"({"name":"a"})",                                   // no path
      R"({"name":"a","path":"/m.uai","colour":"red"})",    // an unknown field
      R"({"name":"a","path":"/m.uai","name":"b"})",        // a duplicate key
      R"({"name":"a","path":"/m.uai","bind":"tree"})",     // bind is pid or none
      R"({"name":"a","path":"/m.uai","wait_seconds":-1})", // no negative wait
      R"({"name":7,"path":"/m.uai"})",                     // a name is a string
      R"([1,2])",                                          // not an object
      R"({"name":"a","path":"/m.uai")",                    // not JSON
  };
  for (const char* b : bodies) {
    INFO(b);
    require_problem(call(h, bhttp::verb::post, "/v1/attach", b), 400, "invalid-request");
  }
  require_problem(call(h, bhttp::verb::post, "/v1/init", R"({"path":"rel.uai"})"), 400, "invalid-request");
  require_problem(call(h, bhttp::verb::post, "/v1/branch", R"({"path":"/a.uai","new_path":"b.uai"})"), 400,
                  "invalid-request");
  require_problem(call(h, bhttp::verb::post, "/v1/fetch", R"({"memory_instance_id":"nope","path":"/a.uai"})"), 400,
                  "invalid-request");
  require_problem(call(h, bhttp::verb::get, "/v1/identify"), 400, "invalid-request");
  require_problem(call(h, bhttp::verb::get, "/v1/lineage"), 400, "invalid-request");
  REQUIRE(svc.calls.empty());
}

TEST_CASE("daemon handler: routing answers 404 and 405 with Allow", "[daemon_handler]") {
  FakeDaemonService svc;
  DaemonHandler h(svc, [](const mep::http::Peer&) { return true; });
  require_problem(call(h, bhttp::verb::get, "/v1/nothing"), 404, "not-found");
  auto res = call(h, bhttp::verb::delete_, "/v1/attach");
  require_problem(res, 405, "method-not-allowed");
  REQUIRE(res[bhttp::field::allow] == "POST");
  res = call(h, bhttp::verb::head, "/v1/events");
  require_problem(res, 405, "method-not-allowed");
  REQUIRE(res[bhttp::field::allow] == "GET");
  // HEAD is GET without the content.
  REQUIRE(call(h, bhttp::verb::head, "/healthz").result_int() == 200);
  REQUIRE(svc.calls.empty());
}

TEST_CASE("daemon handler: answers are encoded as the API says", "[daemon_handler]") {
  FakeDaemonService svc;
  DaemonHandler h(svc, [](const mep::http::Peer&) { return true; });
  auto res = call(h, bhttp::verb::post, "/v1/detach", R"({"name":"a","lease_id":"L1"})");
  REQUIRE(res.result_int() == 204);
  REQUIRE(res.body().empty());
  REQUIRE(svc.calls.at(0).lease_id == std::optional<std::string>("L1"));
  // Ended here, refused by the control plane: 200 with its problem, for the caller to tell.
  svc.control_plane_refusal = mep::Problem(mep::Code::stale_fence, "superseded");
  res = call(h, bhttp::verb::post, "/v1/detach", R"({"name":"a"})");
  REQUIRE(res.result_int() == 200);
  REQUIRE(body_of(res).at("released") == true);
  REQUIRE(body_of(res).at("control_plane").at("code") == "stale-fence");
  svc.control_plane_refusal.reset();
  // verify and sync name the client's lease too, when it gives one.
  REQUIRE(call(h, bhttp::verb::post, "/v1/verify", R"({"name":"a","lease_id":"L2"})").result_int() == 200);
  REQUIRE(svc.calls.back().lease_id == std::optional<std::string>("L2"));
  REQUIRE(call(h, bhttp::verb::post, "/v1/sync", R"({"name":"a","lease_id":"L3"})").result_int() == 200);
  REQUIRE(svc.calls.back().lease_id == std::optional<std::string>("L3"));
  REQUIRE(call(h, bhttp::verb::post, "/v1/sync", R"({"name":"a"})").result_int() == 200);
  REQUIRE(svc.calls.back().lease_id == std::nullopt);

  res = call(h, bhttp::verb::get, "/v1/leases");
  REQUIRE(res.result_int() == 200);
  REQUIRE(body_of(res).at("leases").as_array().size() == 2);

  res = call(h, bhttp::verb::get, "/v1/identify?path=/tmp/./m.uai");
  REQUIRE(res.result_int() == 200);
  REQUIRE(svc.calls.back().paths.at(0) == "/tmp/m.uai");

  res = call(h, bhttp::verb::get, "/metrics");
  REQUIRE(res.result_int() == 200);
  REQUIRE(res.body() == "mepd_up 1\n");

  // The service's problem is the answer, with its status and code.
  svc.problem = mep::Problem(mep::Code::name_held, "held by another owner");
  require_problem(call(h, bhttp::verb::post, "/v1/attach", R"({"name":"a","path":"/m.uai"})"), 423, "name-held");
}

TEST_CASE("daemon handler: an exception in the service is a 500 problem, not a crash", "[daemon_handler]") {
  FakeDaemonService svc;
  DaemonHandler h(svc, [](const mep::http::Peer&) { return true; });
  require_problem(call(h, bhttp::verb::post, "/v1/attach", R"({"name":"throw","path":"/m.uai"})"), 500, "internal");
  require_problem(call(h, bhttp::verb::get, "/v1/leases/throw"), 500, "internal");
  // The handler goes on serving.
  REQUIRE(call(h, bhttp::verb::get, "/v1/leases/a").result_int() == 200);
}

TEST_CASE("daemon handler: only peers the daemon allows are admitted", "[daemon_handler]") {
  FakeDaemonService svc;
  DaemonHandler h(svc, [](const mep::http::Peer& p) { return p.uid == ::geteuid(); });
  REQUIRE_FALSE(h.admit(own_peer()));
  auto other = own_peer();
  other.uid = ::geteuid() + 1;
  auto refused = h.admit(other);
  REQUIRE(refused);
  REQUIRE(refused->status() == 403);
  auto unknown = own_peer();
  unknown.cred_known = false; // SO_PEERCRED did not answer
  REQUIRE(h.admit(unknown));
}
