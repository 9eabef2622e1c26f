// mepd's keeper (daemon/keeper*.cpp) against a scripted control plane: the hard cases the
// integration suites reach only through proxies and signals, decided here by what the
// keeper sends and keeps. A real state database and real files in a temporary directory;
// a scripted data plane where the case needs one.
#include "mep/keeper.hpp"

#include "mep/canonical.hpp"
#include "mep/control_plane.hpp"
#include "mep/data_plane.hpp"
#include "mep/json.hpp"
#include "mep/sqlite.hpp"
#include "mep/time.hpp"

#include <catch2/catch.hpp>

#include <atomic>
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

// A data plane whose fence advances answer what the test says, and which records the
// (memory, token) of each. No object is stored: put and get are not scripted.
class ScriptedDataPlane final : public DataPlane {
public:
  using AdvanceFn = std::function<expected<std::int64_t, Problem>(const std::string&, std::int64_t)>;

  void on_advance(AdvanceFn f) {
    std::lock_guard lock(m_mutex);
    m_advance = std::move(f);
  }
  std::vector<std::pair<std::string, std::int64_t>> advances() const {
    std::lock_guard lock(m_mutex);
    return m_advances;
  }

  expected<std::int64_t, Problem> advance(const std::string& memory_id, std::int64_t token,
                                          std::chrono::milliseconds) override {
    AdvanceFn f;
    {
      std::lock_guard lock(m_mutex);
      m_advances.emplace_back(memory_id, token);
      f = m_advance;
    }
    return f ? f(memory_id, token) : expected<std::int64_t, Problem>(token);
  }
  expected<StoredObject, Problem> put(const std::string&, std::int64_t, int, std::uint64_t) override {
    return make_unexpected(Problem(Code::internal, "not scripted"));
  }
  expected<StoredObject, Problem> get(const std::string&, int) override {
    return make_unexpected(Problem(Code::internal, "not scripted"));
  }
  const std::string& url() const override { return m_url; }

private:
  mutable std::mutex m_mutex;
  AdvanceFn m_advance;
  std::vector<std::pair<std::string, std::int64_t>> m_advances;
  std::string m_url = "scripted";
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

TEST_CASE("a grant the data plane has already seen a higher token for is given back, and the attach says why",
          "[keeper]") {
  // stale-fence at the first advance: a later holder fenced this memory first (this grant
  // expired before it could be fenced, or the control plane lost grants in a failover).
  // The token would only have its holder's writes refused: the lease goes back at once.
  TempDir dir;
  auto owned = std::make_unique<ScriptedControlPlane>();
  auto& cp = *owned;
  auto owned_dp = std::make_unique<ScriptedDataPlane>();
  auto& dp = *owned_dp;
  Keeper keeper(dir.path / "state", std::move(owned), std::move(owned_dp));
  keeper.start();
  cp.on_claim([](const lease::ClaimRequest& req) -> expected<lease::Grant, Problem> { return grant_for(req); });
  dp.on_advance([](const std::string&, std::int64_t) -> expected<std::int64_t, Problem> {
    return make_unexpected(Problem(Code::stale_fence, "scripted: the mark is 7"));
  });
  auto refused = keeper.attach(attach_request(memory_file(dir, "e.uai"), "Late Agent"));
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == Code::stale_fence);
  CHECK(refused.error().detail.find("given back") != std::string::npos);
  REQUIRE(dp.advances().size() == 1); // stale is final: not retried
  const auto released = cp.releases();
  REQUIRE(released.size() == 1);
  CHECK(released[0].canonical_name == canonicalize("Late Agent")->canonical_name);
  CHECK(released[0].fencing_token == 1);
  CHECK(released[0].memory_id == dp.advances()[0].first);
  CHECK(keeper.list(::getuid()).empty());
}

TEST_CASE("a data plane that is restarting during an attach is asked again, and the lease is held once fenced",
          "[keeper]") {
  // store-unavailable says nothing was decided: the attach retries the advance with the
  // same token (for up to 5 s) rather than failing the agent or handing out an unfenced
  // token.
  TempDir dir;
  auto owned = std::make_unique<ScriptedControlPlane>();
  auto& cp = *owned;
  auto owned_dp = std::make_unique<ScriptedDataPlane>();
  auto& dp = *owned_dp;
  Keeper keeper(dir.path / "state", std::move(owned), std::move(owned_dp));
  keeper.start();
  cp.on_claim([](const lease::ClaimRequest& req) -> expected<lease::Grant, Problem> { return grant_for(req); });
  std::atomic<int> calls{0};
  dp.on_advance([&calls](const std::string&, std::int64_t token) -> expected<std::int64_t, Problem> {
    if (++calls <= 2) return make_unexpected(Problem(Code::store_unavailable, "scripted: restarting"));
    return token;
  });
  auto held = keeper.attach(attach_request(memory_file(dir, "f.uai"), "Patient Agent"));
  REQUIRE(held);
  CHECK(held->fencing_token == 1);
  const auto advances = dp.advances();
  REQUIRE(advances.size() == 3);
  for (const auto& a : advances) {
    CHECK(a.first == held->memory_id);
    CHECK(a.second == 1);
  }
  CHECK(cp.releases().empty());
  const auto listed = keeper.list(::getuid());
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].fenced);
}

TEST_CASE("renewals answered by a server whose clock jumped keep the lease on this host's monotonic clock",
          "[keeper]") {
  // The server's expiry is its wall clock's reading; a step of that clock (an hour ahead,
  // then an hour behind) must neither stretch the local deadline past one TTL from the
  // renewal's sending nor end a lease the server just renewed.
  TempDir dir;
  auto owned = std::make_unique<ScriptedControlPlane>();
  auto& cp = *owned;
  Keeper keeper(dir.path / "state", std::move(owned));
  keeper.start();
  cp.on_claim([](const lease::ClaimRequest& req) -> expected<lease::Grant, Problem> { return grant_for(req); });
  std::atomic<long> jump_ms{3'600'000};
  std::atomic<int> renewals{0};
  cp.on_renew([&](const lease::RenewBatchRequest& req) -> expected<lease::RenewBatchResult, Problem> {
    lease::RenewBatchResult out;
    for (const auto& l : req.leases)
      out.results.push_back(lease::RenewItem{l.canonical_name, 200, now_unix_ms() + jump_ms + l.ttl_s * 1000, "", ""});
    ++renewals;
    return out;
  });
  auto held = keeper.attach(attach_request(memory_file(dir, "g.uai"), "Steady Agent"));
  REQUIRE(held);
  const auto ttl = std::chrono::seconds(held->ttl_s);

  // An hour ahead: renewed, and the deadline is still within one TTL of now.
  REQUIRE(eventually([&] { return renewals >= 1; }, 10)); // due at a third of the 5 s TTL
  REQUIRE(eventually([&] { return renewals >= 2; }, 10)); // the first one's answer is applied by now
  auto listed = keeper.list(::getuid());
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].state == LeaseState::held);
  CHECK(listed[0].local_deadline <= SteadyClock::now() + ttl);
  CHECK(listed[0].local_deadline > SteadyClock::now());

  // An hour behind: the server's expiry is in this host's past, but the server renewed it.
  jump_ms = -3'600'000;
  const int before = renewals;
  REQUIRE(eventually([&] { return renewals >= before + 2; }, 10));
  listed = keeper.list(::getuid());
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].state == LeaseState::held);
  CHECK(listed[0].local_deadline > SteadyClock::now());
  CHECK(listed[0].local_deadline <= SteadyClock::now() + ttl);
}
