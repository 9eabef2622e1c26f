// Every error path of a claim on SQLite leaves nothing behind (Beast's fail_count): the
// Nth SQLite step of the claim fails as an I/O error would, for N = 1, 2, … until the
// claim runs to its end. After each failure either the database holds exactly what it held
// before, the caller got 503 or 500, and the same claim under the same key then succeeds
// (a failure is never stored under the Idempotency-Key); or the store's second, careful
// pass got past it and the claim took effect exactly once.
#include "../../support/store_test_support.hpp"
#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/sqlite.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/uuid.hpp"

#include <catch2/catch.hpp>
#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <vector>

using namespace mep;
using namespace mep::server;

namespace {

// Every row of every table but `settings` (the lease clock's checkpoint and the readiness
// probe live there), in a stable order, read through a connection of its own.
std::string dump(const std::filesystem::path& db_path) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open_v2(db_path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK);
  std::string out;
  std::vector<std::string> tables;
  sqlite3_stmt* t = nullptr;
  REQUIRE(sqlite3_prepare_v2(db,
                             "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                             "AND name <> 'settings' ORDER BY name",
                             -1, &t, nullptr) == SQLITE_OK);
  while (sqlite3_step(t) == SQLITE_ROW) tables.emplace_back(reinterpret_cast<const char*>(sqlite3_column_text(t, 0)));
  sqlite3_finalize(t);
  for (const auto& name : tables) {
    out += "[" + name + "]\n";
    sqlite3_stmt* s = nullptr;
    REQUIRE(sqlite3_prepare_v2(db, ("SELECT * FROM \"" + name + "\"").c_str(), -1, &s, nullptr) == SQLITE_OK);
    std::vector<std::string> rows;
    while (sqlite3_step(s) == SQLITE_ROW) {
      std::string row;
      for (int i = 0; i < sqlite3_column_count(s); ++i) {
        const auto* v = sqlite3_column_text(s, i);
        row += v ? reinterpret_cast<const char*>(v) : "NULL";
        row += '|';
      }
      rows.push_back(std::move(row));
    }
    sqlite3_finalize(s);
    std::sort(rows.begin(), rows.end());
    for (const auto& r : rows) out += r + "\n";
  }
  sqlite3_close(db);
  return out;
}

} // namespace

TEST_CASE("a claim that fails at any SQLite step leaves the database as it was", "[store][faults]") {
  test::TempDir dir("mep-store-faults");
  // No injected failure outlives the test, whatever ends it.
  struct Disarm {
    ~Disarm() { sqlite::fault::fail_step(0); }
  } disarm;
  int completed_at = 0;
  int recovered = 0; // failures the store's careful second pass got past
  for (int n = 1; n <= 500 && completed_at == 0; ++n) {
    INFO("the claim's step " << n << " fails");
    const auto db_path = dir.path / ("faults-" + std::to_string(n) + ".db");
    SqliteStore store("sqlite:" + db_path.string());
    auto [tenant_id, token] = store.create_token("faults", Scope::lease);
    auto auth = store.authenticate(sha256_hex(token));
    REQUIRE(auth);
    Ctx ctx{*auth, uuid_v7().to_string()};
    auto reg = test::wait_outcome<lease::Registered>([&](auto then) {
      store.register_memory(ctx, {"reg", "fp-reg"}, {}, then);
    });
    REQUIRE(reg.ok());
    const std::string memory = reg.value->memory_id;
    auto claim = [&](const std::string& owner, const std::string& key) {
      Claim req{"Faulty", canonicalize("Faulty"), memory, owner, 30};
      return test::wait_outcome<lease::Grant>([&](auto then) { store.claim(ctx, {key, "fp-" + owner}, req, then); });
    };
    // Before: owner-a held the memory under the name and released it, so the claim below
    // rewrites a released row, bumps the counter, writes the name's history, the audit
    // and the idempotency record: every write a claim makes.
    auto first = claim("owner-a", "first");
    REQUIRE(first.ok());
    auto released = test::wait_outcome<Released>([&](auto then) {
      store.release(ctx, LeaseRef{first.value->canonical_name, memory, first.value->fencing_token, "owner-a", 30},
                    then);
    });
    REQUIRE(released.ok());
    const std::string before = dump(db_path);

    sqlite::fault::fail_step(n);
    auto out = claim("owner-b", "second");
    const bool fired = sqlite::fault::left() == 0;
    sqlite::fault::fail_step(0);
    if (!fired) {
      // The claim ran to its end in fewer than n steps: every earlier step was tried.
      REQUIRE(out.ok());
      CHECK(out.value->fencing_token == 2);
      completed_at = n;
      break;
    }
    if (out.ok()) {
      // A step of the optimistic pass failed after the job wrote: the batch was rolled back
      // and ran again, each job in a savepoint (SqliteStore::run_batch), and the retry
      // went through. The claim took effect once: the next token, and a replay says so.
      CHECK(out.value->fencing_token == 2);
      auto replay = claim("owner-b", "second");
      REQUIRE(replay.ok());
      CHECK(replay.replayed);
      CHECK(replay.value->lease_id == out.value->lease_id);
      auto mem = test::wait_outcome<lease::Memory>([&](auto then) { store.get_memory(ctx, memory, then); });
      REQUIRE(mem.ok());
      CHECK(mem.value->fencing_token_high_water == 2);
      ++recovered;
      continue;
    }
    CHECK((out.value.error().code == Code::unavailable || out.value.error().code == Code::internal));
    CHECK(dump(db_path) == before);
    // Nothing of the failure is kept under the key: the same claim runs and is granted.
    auto again = claim("owner-b", "second");
    REQUIRE(again.ok());
    CHECK_FALSE(again.replayed);
    CHECK(again.value->fencing_token == 2);
  }
  // The claim takes more steps than this (idempotency lookup, memory, conflicts, counter,
  // lease, name history, audit, record, BEGIN and COMMIT): each of them was made to fail.
  CHECK(completed_at > 10);
  CHECK(recovered < completed_at - 1); // most failures are answered as failures
}
