// Renewals answered from memory by a serving SQLite store ("Renewals from memory" in
// server/sqlite/store.cpp), on real files: what it answers, what it tells the database, and what
// a restart after a crash makes of the renewals it had not written.
#include "../../support/store_test_support.hpp"
#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/metrics.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/uuid.hpp"

#include <catch2/catch.hpp>
#include <sqlite3.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

using namespace mep;
using namespace mep::server;

namespace {

struct Serving {
  explicit Serving(std::filesystem::path db) : path(std::move(db)) { open(); }
  void open() {
    store = std::make_unique<SqliteStore>("sqlite:" + path.string(), true, 0, /*serving=*/true);
    if (token.empty()) token = store->create_token("renewals", Scope::lease).second;
    auto auth = store->authenticate(sha256_hex(token));
    REQUIRE(auth);
    ctx = Ctx{*auth, uuid_v7().to_string()};
  }
  lease::Grant claim(const std::string& name, int ttl, const std::string& owner = "owner") {
    auto reg = test::wait_outcome<lease::Registered>([&](auto then) {
      store->register_memory(ctx, {"reg-" + name + owner, "fp-reg-" + name + owner}, {}, then);
    });
    REQUIRE(reg.ok());
    return claim_memory(name, reg.value->memory_id, ttl, owner).value();
  }
  expected<lease::Grant, Problem> claim_memory(const std::string& name, const std::string& memory, int ttl,
                                               const std::string& owner) {
    Claim req{name, canonicalize(name), memory, owner, ttl};
    auto g = test::wait_outcome<lease::Grant>([&](auto then) {
      const std::string key = uuid_v7().to_string(); // each call a claim of its own
      store->claim(ctx, {"claim-" + key, "fp-" + key}, req, then);
    });
    if (!g.ok()) return make_unexpected(g.value.error());
    return *g.value;
  }
  Outcome<lease::Renewed> renew(const lease::Grant& g, int ttl, const std::string& owner = "owner") {
    LeaseRef ref{g.canonical_name, g.memory_id, g.fencing_token, owner, ttl};
    return test::wait_outcome<lease::Renewed>([&](auto then) { store->renew(ctx, ref, then); });
  }
  double from_memory() {
    store->sweep(); // sets the counter
    return Metrics::global().value("mep_sqlite_renewals_from_memory_total");
  }

  std::filesystem::path path;
  std::unique_ptr<SqliteStore> store;
  std::string token;
  Ctx ctx;
};

std::int64_t row_expiry(const std::filesystem::path& db, const std::string& memory_id) {
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
  sqlite3_stmt* s = nullptr;
  REQUIRE(sqlite3_prepare_v2(h, "SELECT expires_at FROM leases WHERE memory_id = ?1", -1, &s, nullptr) == SQLITE_OK);
  sqlite3_bind_text(s, 1, memory_id.c_str(), -1, SQLITE_TRANSIENT);
  std::int64_t out = -1;
  if (sqlite3_step(s) == SQLITE_ROW) out = sqlite3_column_int64(s, 0);
  sqlite3_finalize(s);
  sqlite3_close(h);
  return out;
}

void set_row_expiry(const std::filesystem::path& db, const std::string& memory_id, std::int64_t expires) {
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
  sqlite3_busy_timeout(h, 5000);
  const std::string sql =
      "UPDATE leases SET expires_at = " + std::to_string(expires) + " WHERE memory_id = '" + memory_id + "'";
  REQUIRE(sqlite3_exec(h, sql.c_str(), nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(h);
}

} // namespace

TEST_CASE("a serving store answers renewals from memory and tells the database after", "[renewals][store]") {
  test::TempDir dir("mep-renewals-memory");
  Serving s(dir.path / "m.db");
  auto g = s.claim("Remembered", 30);
  const double before = s.from_memory();
  REQUIRE(s.renew(g, 30).ok()); // the writer's; it hands the lease over
  CHECK(s.from_memory() == before);
  UnixMs last = 0;
  for (int i = 0; i < 10; ++i) {
    auto r = s.renew(g, 30);
    REQUIRE(r.ok());
    last = r.value->expires_at;
  }
  CHECK(s.from_memory() == before + 10); // the sweep's batch wrote them, too
  CHECK(row_expiry(s.path, g.memory_id) == last);

  // Readers see a renewal the database has not been told yet (the row as a lagging write
  // could leave it: ended a second ago).
  const auto wall_ms = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  set_row_expiry(s.path, g.memory_id, wall_ms() - 1000);
  auto r = s.renew(g, 30);
  REQUIRE(r.ok());
  auto info =
      test::wait_outcome<lease::LeaseInfo>([&](auto then) { s.store->get_lease(s.ctx, g.canonical_name, then); });
  REQUIRE(info.ok());
  CHECK(info.value->grant.expires_at == r.value->expires_at);
  auto page = test::wait_outcome<lease::LeasePage>([&](auto then) { s.store->list_leases(s.ctx, ListLeases{}, then); });
  REQUIRE(page.ok());
  REQUIRE(page.value->leases.size() == 1);
  CHECK(page.value->leases[0].grant.expires_at == r.value->expires_at);

  // A renewal with another TTL goes to the writer, and is answered as before.
  const double mem = s.from_memory();
  auto longer = s.renew(g, 60);
  REQUIRE(longer.ok());
  CHECK(longer.value->ttl_s == 60);
  CHECK(s.from_memory() == mem);
}

TEST_CASE("nobody is granted a lease a renewal from memory kept alive", "[renewals][store]") {
  test::TempDir dir("mep-renewals-claim");
  Serving s(dir.path / "c.db");
  auto g = s.claim("Kept", 30);
  REQUIRE(s.renew(g, 30).ok());
  auto r = s.renew(g, 30); // from memory
  REQUIRE(r.ok());
  s.store->sweep(); // written: what is left to find it is the table itself
  // The row as if the write had not happened: ended. The store must still hold the lease
  // for its holder until the expiry it acknowledged.
  set_row_expiry(s.path, g.memory_id, 1);
  auto other = s.claim_memory("Kept", g.memory_id, 30, "another-owner");
  REQUIRE_FALSE(other.has_value());
  CHECK(other.error().code == Code::name_held);
  CHECK(row_expiry(s.path, g.memory_id) == r.value->expires_at); // written back before the claim looked
  CHECK(s.renew(g, 30).ok());
}

TEST_CASE("a released lease is not renewed from memory", "[renewals][store]") {
  test::TempDir dir("mep-renewals-release");
  Serving s(dir.path / "r.db");
  auto g = s.claim("Released", 30);
  REQUIRE(s.renew(g, 30).ok());
  REQUIRE(s.renew(g, 30).ok()); // from memory
  LeaseRef ref{g.canonical_name, g.memory_id, g.fencing_token, "owner", 30};
  auto rel = test::wait_outcome<Released>([&](auto then) { s.store->release(s.ctx, ref, then); });
  REQUIRE(rel.ok());
  auto after = s.renew(g, 30);
  REQUIRE_FALSE(after.ok());
  CHECK(after.value.error().code == Code::lease_expired);
  // A new grant of the memory starts over: its first renewal is the writer's.
  auto again = s.claim_memory("Released", g.memory_id, 30, "owner");
  REQUIRE(again.has_value());
  CHECK(again->fencing_token > g.fencing_token);
  CHECK(s.renew(*again, 30).ok());
}

TEST_CASE("after a crash, a lease renewed from memory keeps at least its TTL from the restart", "[renewals][store]") {
  test::TempDir dir("mep-renewals-crash");
  Serving s(dir.path / "k.db");
  auto g = s.claim("Crashed", 30);
  REQUIRE(s.renew(g, 30).ok());
  s.store->sweep(); // a clock checkpoint after the lease's row is live
  auto r = s.renew(g, 30);
  REQUIRE(r.ok());
  // The files as kill -9 would leave them: the database still marked as served.
  const auto copy = dir.path / "copy.db";
  for (std::string ext : {"", "-wal"}) std::filesystem::copy_file(s.path.string() + ext, copy.string() + ext);
  s.store.reset();
  // Clean stop: the last renewal was written and nothing is extended at the next start.
  s.open();
  CHECK(row_expiry(s.path, g.memory_id) == r.value->expires_at);
  s.store.reset();

  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  Serving crashed(copy);
  const std::int64_t after = row_expiry(copy, g.memory_id);
  INFO("acknowledged " << r.value->expires_at << ", after the restart " << after);
  CHECK(after >= r.value->expires_at + 1000); // at least the TTL from the (later) start
  CHECK(crashed.renew(g, 30).ok());
}
