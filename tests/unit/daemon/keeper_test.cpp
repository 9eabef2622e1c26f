// mepd's keeper (daemon/keeper*.cpp) against a scripted control plane: the hard cases the
// integration suites reach only through proxies and signals, decided here by what the
// keeper sends and keeps. A real state database and real files in a temporary directory;
// no data plane.
#include "mep/keeper.hpp"

#include "mep/canonical.hpp"
#include "mep/control_plane.hpp"
#include "mep/json.hpp"
#include "mep/sqlite.hpp"
#include "mep/time.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

using namespace mep;
using namespace mep::daemon;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/mep-keeper-XXXXXX";
    path = ::mkdtemp(tmpl);
    fs::create_directory(path / "state"); // mepd's state directory (mepd makes it)
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// A control plane whose claims and renewals answer what the test says, and which records
// what the keeper sent. Everything else a claim does not need answers an empty success.
class ScriptedControlPlane final : public ControlPlane {
public:
  using ClaimFn = std::function<expected<lease::Grant, Problem>(const lease::ClaimRequest&)>;
  using RenewFn = std::function<expected<lease::RenewBatchResult, Problem>(const lease::RenewBatchRequest&)>;

  void on_claim(ClaimFn f) {
    std::lock_guard lock(m_mutex);
    m_claim = std::move(f);
  }
  void on_renew(RenewFn f) {
    std::lock_guard lock(m_mutex);
    m_renew = std::move(f);
  }
  std::vector<std::string> claim_keys() const {
    std::lock_guard lock(m_mutex);
    return m_claim_keys;
  }
  std::vector<lease::LeaseRef> releases() const {
    std::lock_guard lock(m_mutex);
    return m_releases;
  }

  expected<lease::Registered, Problem> register_memory(const std::string& memory_id) override {
    return lease::Registered{memory_id, now_unix_ms(), true};
  }
  expected<lease::Grant, Problem> claim(const lease::ClaimRequest& req, const std::string& key,
                                        const ClaimWait&) override {
    ClaimFn f;
    {
      std::lock_guard lock(m_mutex);
      m_claim_keys.push_back(key);
      f = m_claim;
    }
    return f(req);
  }
  expected<lease::RenewBatchResult, Problem> renew_batch(const lease::RenewBatchRequest& req,
                                                         std::chrono::milliseconds) override {
    RenewFn f;
    {
      std::lock_guard lock(m_mutex);
      f = m_renew;
    }
    if (f) return f(req);
    lease::RenewBatchResult out;
    for (const auto& l : req.leases)
      out.results.push_back(lease::RenewItem{l.canonical_name, 200, now_unix_ms() + l.ttl_s * 1000, "", ""});
    return out;
  }
  expected<void, Problem> release(const lease::LeaseRef& ref) override {
    std::lock_guard lock(m_mutex);
    m_releases.push_back(ref);
    return {};
  }
  expected<lease::Branched, Problem> branch(const lease::BranchRequest&, const std::string&) override {
    return make_unexpected(Problem(Code::internal, "not scripted"));
  }
  expected<lease::Memory, Problem> memory(const std::string&) override {
    return make_unexpected(Problem(Code::internal, "not scripted"));
  }
  expected<lease::Lineage, Problem> lineage(const std::string&) override {
    return make_unexpected(Problem(Code::internal, "not scripted"));
  }
  expected<lease::Verified, Problem> verify(const lease::VerifyRequest&) override {
    return make_unexpected(Problem(Code::internal, "not scripted"));
  }
  expected<lease::IdentityMapPage, Problem> identity_map(const std::optional<std::string>&, std::size_t) override {
    return lease::IdentityMapPage{};
  }
  std::string describe() const override { return "scripted"; }

private:
  mutable std::mutex m_mutex;
  ClaimFn m_claim;
  RenewFn m_renew;
  std::vector<std::string> m_claim_keys;
  std::vector<lease::LeaseRef> m_releases;
};

// What a server grants for `req`: token 1, the TTL asked for.
lease::Grant grant_for(const lease::ClaimRequest& req) {
  lease::Grant g;
  g.lease_id = "01a2f000-0000-7000-8000-000000000001";
  g.canonical_name = canonicalize(req.display_name)->canonical_name;
  g.display_name = req.display_name;
  g.memory_id = req.memory_id;
  g.fencing_token = 1;
  g.ttl_s = req.ttl_s;
  g.server_time = now_unix_ms();
  g.expires_at = g.server_time + req.ttl_s * 1000;
  return g;
}

AttachRequest attach_request(const fs::path& file, const std::string& name) {
  AttachRequest req;
  req.name = name;
  req.path = file;
  req.ttl_s = 5;
  req.bind_pid = false;
  req.pid = ::getpid();
  req.uid = ::getuid();
  req.gid = ::getgid();
  return req;
}

fs::path memory_file(const TempDir& dir, const std::string& name) {
  fs::path p = dir.path / name;
  std::ofstream(p) << "memory\n";
  return p;
}

// Polls `done` every 20 ms for up to `seconds`.
bool eventually(const std::function<bool()>& done, int seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

} // namespace

TEST_CASE("an attach whose claim went unanswered is refused, and the grant its resend finds is given back",
          "[keeper]") {
  // The control plane cannot be reached: the claim's outcome is unknown, so the agent is
  // told it failed and the intent stays. When the control plane answers the resend (same
  // Idempotency-Key) with a grant, nobody holds it here: the keeper releases it, never
  // adopts it.
  TempDir dir;
  auto owned = std::make_unique<ScriptedControlPlane>();
  auto& cp = *owned;
  Keeper keeper(dir.path / "state", std::move(owned));
  keeper.start();
  cp.on_claim([](const lease::ClaimRequest&) -> expected<lease::Grant, Problem> {
    return make_unexpected(unreachable("scripted"));
  });
  auto refused = keeper.attach(attach_request(memory_file(dir, "a.uai"), "Unanswered Agent"));
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == Code::control_plane_unreachable);
  CHECK(keeper.list(::getuid()).empty());

  cp.on_claim([](const lease::ClaimRequest& req) -> expected<lease::Grant, Problem> { return grant_for(req); });
  REQUIRE(eventually([&] { return !cp.releases().empty(); }, 15)); // the renewer resends every 2 s
  const auto keys = cp.claim_keys();
  REQUIRE(keys.size() >= 2);
  for (const auto& key : keys) CHECK(key == keys.front()); // the attach's tries and the resend: one claim
  const auto released = cp.releases();
  REQUIRE(released.size() == 1);
  CHECK(released[0].canonical_name == canonicalize("Unanswered Agent")->canonical_name);
  CHECK(released[0].fencing_token == 1);
  CHECK(keeper.list(::getuid()).empty());
}

TEST_CASE("renewals the control plane does not answer degrade the lease, saying it is unreachable", "[keeper]") {
  // The reason is decided by the problem's code (control-plane-unreachable), not by
  // reading its text (it was a substring match on "unreachable" in the detail).
  TempDir dir;
  std::mutex mutex; // declared before the keeper: its threads may call the sink until it stops
  std::vector<boost::json::object> events;
  auto owned = std::make_unique<ScriptedControlPlane>();
  auto& cp = *owned;
  Keeper keeper(dir.path / "state", std::move(owned));
  keeper.start();
  cp.on_claim([](const lease::ClaimRequest& req) -> expected<lease::Grant, Problem> { return grant_for(req); });
  const int sink = keeper.subscribe(
      [&](const std::string& line) {
        if (auto o = json::parse_object(line)) {
          std::lock_guard lock(mutex);
          events.push_back(std::move(*o));
        }
      },
      ::getuid());
  auto held = keeper.attach(attach_request(memory_file(dir, "b.uai"), "Quiet Agent"));
  REQUIRE(held);
  cp.on_renew([](const lease::RenewBatchRequest&) -> expected<lease::RenewBatchResult, Problem> {
    // A detail without the word: only the code can say what happened.
    return make_unexpected(Problem(Code::control_plane_unreachable, "no route to host"));
  });
  auto degraded = [&](std::string* reason) {
    std::lock_guard lock(mutex);
    for (const auto& e : events)
      if (e.contains("event") && e.at("event") == "degraded") {
        if (reason && e.contains("reason") && e.at("reason").is_string()) *reason = e.at("reason").as_string().c_str();
        return true;
      }
    return false;
  };
  // The first renewal is due at a third of the 5 s TTL.
  REQUIRE(eventually([&] { return degraded(nullptr); }, 10));
  std::string reason;
  degraded(&reason);
  CHECK(reason == "unreachable");
  keeper.unsubscribe(sink);
}

TEST_CASE("a claim the control plane rate-limits is sent again after its Retry-After, under the same key", "[keeper]") {
  // 429 says nothing was done: the attach comes back after Retry-After instead of failing
  // the agent, with the same Idempotency-Key (so a grant is never made twice).
  TempDir dir;
  auto owned = std::make_unique<ScriptedControlPlane>();
  auto& cp = *owned;
  Keeper keeper(dir.path / "state", std::move(owned));
  keeper.start();
  int calls = 0;
  cp.on_claim([&calls](const lease::ClaimRequest& req) -> expected<lease::Grant, Problem> {
    if (++calls == 1) {
      Problem p(Code::rate_limited, "scripted");
      p.retry_after_s = 1;
      return make_unexpected(p);
    }
    return grant_for(req);
  });
  const auto started = std::chrono::steady_clock::now();
  auto held = keeper.attach(attach_request(memory_file(dir, "c.uai"), "Busy Agent"));
  REQUIRE(held);
  CHECK(held->fencing_token == 1);
  CHECK(std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(900)); // it waited
  const auto keys = cp.claim_keys();
  REQUIRE(keys.size() == 2);
  CHECK(keys[1] == keys[0]);
  REQUIRE(keeper.list(::getuid()).size() == 1);
}

TEST_CASE("an attach whose claim intent cannot be written is refused before anything is sent", "[keeper]") {
  // The intent is what lets a daemon that crashes mid-claim resend the same key instead of
  // claiming twice: a claim is never sent without it (a full disk answers 503 at once).
  TempDir dir;
  auto owned = std::make_unique<ScriptedControlPlane>();
  auto& cp = *owned;
  Keeper keeper(dir.path / "state", std::move(owned));
  keeper.start();
  cp.on_claim([](const lease::ClaimRequest& req) -> expected<lease::Grant, Problem> { return grant_for(req); });
  {
    sqlite::Db db((dir.path / "state" / "mepd.db").string(), sqlite::Mode::read_write_create);
    db.exec("CREATE TRIGGER refuse_intents BEFORE INSERT ON intents "
            "BEGIN SELECT RAISE(ABORT, 'injected: intents refused'); END");
  }
  auto refused = keeper.attach(attach_request(memory_file(dir, "d.uai"), "Unwritten Agent"));
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == Code::unavailable);
  CHECK(refused.error().detail.find("state directory") != std::string::npos);
  CHECK(cp.claim_keys().empty());
  CHECK(keeper.list(::getuid()).empty());
}
