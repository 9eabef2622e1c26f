// What the SQLite store puts on disk, and when (server/sqlite/store.cpp, "Renewals" and
// "checkpoints"), seen through a VFS that counts every sync SQLite asks for:
// - a batch of renewals commits without a sync; a claim, and a renewal that raises its
//   lease's TTL, are synced before they are answered;
// - after a reboot (another boot id in the clock's checkpoint) a lease live at the
//   checkpoint keeps its TTL at least, so a renewal lost with the reboot is made good;
// - after renewals checkpoints run on the store's checkpointer thread and the log stays
//   bounded; after synced commits the writer checkpoints, as SQLite does.
#include "../../support/store_test_support.hpp"
#include "mep/canonical.hpp"
#include "mep/crypto.hpp"
#include "mep/metrics.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/uuid.hpp"

#include <catch2/catch.hpp>
#include <sqlite3.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <memory>
#include <string>
#include <vector>

using namespace mep;
using namespace mep::server;

namespace {

// ---- a VFS that counts syncs of the log ("-wal") and of the database file ----------------

std::atomic<int> g_wal_syncs{0};
std::atomic<int> g_db_syncs{0};
sqlite3_vfs* g_real = nullptr;

struct CountingFile {
  sqlite3_file base;
  sqlite3_file* real; // allocated right after this struct
  bool wal;
};

sqlite3_file* real_of(sqlite3_file* f) { return reinterpret_cast<CountingFile*>(f)->real; }

int c_close(sqlite3_file* f) { return real_of(f)->pMethods->xClose(real_of(f)); }
int c_read(sqlite3_file* f, void* b, int n, sqlite3_int64 o) {
  return real_of(f)->pMethods->xRead(real_of(f), b, n, o);
}
int c_write(sqlite3_file* f, const void* b, int n, sqlite3_int64 o) {
  return real_of(f)->pMethods->xWrite(real_of(f), b, n, o);
}
int c_truncate(sqlite3_file* f, sqlite3_int64 n) { return real_of(f)->pMethods->xTruncate(real_of(f), n); }
int c_sync(sqlite3_file* f, int flags) {
  (reinterpret_cast<CountingFile*>(f)->wal ? g_wal_syncs : g_db_syncs)++;
  return real_of(f)->pMethods->xSync(real_of(f), flags);
}
int c_size(sqlite3_file* f, sqlite3_int64* n) { return real_of(f)->pMethods->xFileSize(real_of(f), n); }
int c_lock(sqlite3_file* f, int l) { return real_of(f)->pMethods->xLock(real_of(f), l); }
int c_unlock(sqlite3_file* f, int l) { return real_of(f)->pMethods->xUnlock(real_of(f), l); }
int c_reserved(sqlite3_file* f, int* r) { return real_of(f)->pMethods->xCheckReservedLock(real_of(f), r); }
int c_control(sqlite3_file* f, int op, void* arg) {
  // SQLite hands its own file objects around through some of these (the log's, for one):
  // they are this VFS's, so they pass through unchanged.
  return real_of(f)->pMethods->xFileControl(real_of(f), op, arg);
}
int c_sector(sqlite3_file* f) { return real_of(f)->pMethods->xSectorSize(real_of(f)); }
int c_device(sqlite3_file* f) { return real_of(f)->pMethods->xDeviceCharacteristics(real_of(f)); }
int c_shm_map(sqlite3_file* f, int r, int sz, int ext, void volatile** p) {
  return real_of(f)->pMethods->xShmMap(real_of(f), r, sz, ext, p);
}
int c_shm_lock(sqlite3_file* f, int o, int n, int fl) { return real_of(f)->pMethods->xShmLock(real_of(f), o, n, fl); }
void c_shm_barrier(sqlite3_file* f) { real_of(f)->pMethods->xShmBarrier(real_of(f)); }
int c_shm_unmap(sqlite3_file* f, int del) { return real_of(f)->pMethods->xShmUnmap(real_of(f), del); }
int c_fetch(sqlite3_file* f, sqlite3_int64 o, int n, void** p) {
  return real_of(f)->pMethods->xFetch(real_of(f), o, n, p);
}
int c_unfetch(sqlite3_file* f, sqlite3_int64 o, void* p) { return real_of(f)->pMethods->xUnfetch(real_of(f), o, p); }

const sqlite3_io_methods k_methods = {
    3,         c_close,  c_read,   c_write,   c_truncate, c_sync,        c_size,      c_lock,  c_unlock, c_reserved,
    c_control, c_sector, c_device, c_shm_map, c_shm_lock, c_shm_barrier, c_shm_unmap, c_fetch, c_unfetch};

int c_open(sqlite3_vfs*, sqlite3_filename name, sqlite3_file* f, int flags, int* out) {
  auto* cf = reinterpret_cast<CountingFile*>(f);
  cf->real = reinterpret_cast<sqlite3_file*>(cf + 1);
  cf->wal = (flags & SQLITE_OPEN_WAL) != 0;
  int rc = g_real->xOpen(g_real, name, cf->real, flags, out);
  cf->base.pMethods = cf->real->pMethods ? &k_methods : nullptr;
  return rc;
}

// Makes the counting VFS the default while it lives (every connection opened meanwhile
// uses it), and the real one again after.
struct CountingVfs {
  CountingVfs() {
    g_real = sqlite3_vfs_find(nullptr);
    REQUIRE(g_real != nullptr);
    REQUIRE(g_real->iVersion >= 2);
    m_vfs = *g_real;
    m_vfs.zName = "mep-counting";
    m_vfs.szOsFile = static_cast<int>(sizeof(CountingFile)) + g_real->szOsFile;
    m_vfs.xOpen = c_open;
    REQUIRE(sqlite3_vfs_register(&m_vfs, 1) == SQLITE_OK);
  }
  ~CountingVfs() {
    sqlite3_vfs_register(g_real, 1);
    sqlite3_vfs_unregister(&m_vfs);
  }
  sqlite3_vfs m_vfs{};
};

// ---- a store with a tenant, and leases in it -----------------------------------------------

struct Fixture {
  explicit Fixture(const std::filesystem::path& db, int wal_writer_frames = 32000)
      : path(db), wal_frames(wal_writer_frames) {
    open();
  }
  void open() {
    store = std::make_unique<SqliteStore>("sqlite:" + path.string(), true, 0, false, wal_frames);
    if (token.empty()) token = store->create_token("durability", Scope::lease).second;
    auto auth = store->authenticate(sha256_hex(token));
    REQUIRE(auth);
    ctx = Ctx{*auth, uuid_v7().to_string()};
  }
  lease::Grant claim(const std::string& name, int ttl) {
    auto reg = test::wait_outcome<lease::Registered>([&](auto then) {
      store->register_memory(ctx, {"reg-" + name, "fp-reg-" + name}, {}, then);
    });
    REQUIRE(reg.ok());
    Claim req{name, canonicalize(name), reg.value->memory_id, "owner-" + name, ttl};
    auto g = test::wait_outcome<lease::Grant>([&](auto then) {
      store->claim(ctx, {"claim-" + name, "fp-claim-" + name}, req, then);
    });
    REQUIRE(g.ok());
    return *g.value;
  }
  LeaseRef ref(const lease::Grant& g, int ttl) {
    return LeaseRef{g.canonical_name, g.memory_id, g.fencing_token, "owner-" + g.display_name, ttl};
  }
  Outcome<lease::Renewed> renew(const lease::Grant& g, int ttl) {
    return test::wait_outcome<lease::Renewed>([&](auto then) { store->renew(ctx, ref(g, ttl), then); });
  }
  lease::Grant get(const lease::Grant& g) {
    auto info = test::wait_outcome<lease::LeaseInfo>([&](auto then) { store->get_lease(ctx, g.canonical_name, then); });
    REQUIRE(info.ok());
    return info.value->grant;
  }

  std::filesystem::path path;
  int wal_frames;
  std::unique_ptr<SqliteStore> store;
  std::string token;
  Ctx ctx;
};

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Runs one statement on the database file through a connection of its own.
void exec(const std::filesystem::path& db, const std::string& sql) {
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(h, sql.c_str(), nullptr, nullptr, &err);
  INFO(sql << ": " << (err ? err : ""));
  sqlite3_free(err);
  sqlite3_close(h);
  REQUIRE(rc == SQLITE_OK);
}

std::string query(const std::filesystem::path& db, const std::string& sql) {
  sqlite3* h = nullptr;
  REQUIRE(sqlite3_open(db.c_str(), &h) == SQLITE_OK);
  sqlite3_stmt* s = nullptr;
  REQUIRE(sqlite3_prepare_v2(h, sql.c_str(), -1, &s, nullptr) == SQLITE_OK);
  std::string out;
  if (sqlite3_step(s) == SQLITE_ROW && sqlite3_column_text(s, 0))
    out = reinterpret_cast<const char*>(sqlite3_column_text(s, 0));
  sqlite3_finalize(s);
  sqlite3_close(h);
  return out;
}

} // namespace

TEST_CASE("renewals commit without a sync, claims and a longer TTL with one", "[store][durability]") {
  CountingVfs vfs;
  test::TempDir dir("mep-durability");
  Fixture f(dir.path / "d.db");
  auto g = f.claim("Synced", 30);
  auto& metrics = Metrics::global();

  const int wal_before = g_wal_syncs;
  const double deferred_before = metrics.value("mep_sqlite_commits_total", "sync=\"deferred\"");
  for (int i = 0; i < 20; ++i) REQUIRE(f.renew(g, 30).ok());
  CHECK(g_wal_syncs == wal_before);
  CHECK(metrics.value("mep_sqlite_commits_total", "sync=\"deferred\"") - deferred_before == 20);

  // A renewal that lengthens the TTL is on disk before it is answered.
  const double synced_before = metrics.value("mep_sqlite_commits_total", "sync=\"fsync\"");
  auto longer = f.renew(g, 60);
  REQUIRE(longer.ok());
  CHECK(longer.value->ttl_s == 60);
  CHECK(g_wal_syncs == wal_before + 1);
  CHECK(metrics.value("mep_sqlite_commits_total", "sync=\"fsync\"") - synced_before == 1);
  // The same TTL, or a shorter one, again without.
  REQUIRE(f.renew(g, 60).ok());
  REQUIRE(f.renew(g, 45).ok());
  CHECK(g_wal_syncs == wal_before + 1);

  // A claim is synced: the log at least once before the answer.
  const int before_claim = g_wal_syncs;
  f.claim("Another", 30);
  CHECK(g_wal_syncs > before_claim);
  // And so is the sweep's batch, which saves the clock's checkpoint.
  const int before_sweep = g_wal_syncs;
  f.store->sweep();
  CHECK(g_wal_syncs == before_sweep + 1);
}

TEST_CASE("after a reboot a lease live at the clock's checkpoint keeps its TTL", "[store][durability]") {
  test::TempDir dir("mep-reboot");
  Fixture f(dir.path / "r.db");
  auto lost = f.claim("Lost", 30);       // its last renewals were lost with the reboot
  auto ample = f.claim("Ample", 30);     // it had more time left than its TTL
  auto expired = f.claim("Expired", 30); // expired before the checkpoint
  // No sweep has run: the checkpoint is the one a new database saves as it opens.
  f.store.reset();

  const std::string checkpoint = query(f.path, "SELECT value FROM settings WHERE key = 'lease_clock_checkpoint'");
  long long saved = 0, boot_ms = 0;
  REQUIRE(std::sscanf(checkpoint.c_str(), "%lld %lld", &saved, &boot_ms) == 2);
  // The disk as a power loss may leave it: "Lost" renewed last just after the checkpoint,
  // with 0.5 s left then; the boot id another than this boot's.
  exec(f.path, "UPDATE settings SET value = '" + std::to_string(saved) + " " + std::to_string(boot_ms) +
                   " another-boot' WHERE key = 'lease_clock_checkpoint'");
  exec(f.path,
       "UPDATE leases SET expires_at = " + std::to_string(saved + 500) + " WHERE memory_id = '" + lost.memory_id + "'");
  exec(f.path, "UPDATE leases SET expires_at = " + std::to_string(saved + 100000) + " WHERE memory_id = '" +
                   ample.memory_id + "'");
  exec(f.path, "UPDATE leases SET expires_at = " + std::to_string(saved - 1) + " WHERE memory_id = '" +
                   expired.memory_id + "'");

  const std::int64_t start = now_ms();
  f.open();
  const auto lost_info = f.get(lost);
  INFO("the lease clock started near " << start << "; saved " << saved);
  CHECK(lost_info.expires_at >= start + 30000 - 2000);
  CHECK(f.get(ample).expires_at >= start + 100000 - 2000);
  // A lease expired at the checkpoint is not revived: its holder cannot renew it.
  auto r = f.renew(expired, 30);
  REQUIRE_FALSE(r.ok());
  CHECK(r.value.error().code == Code::lease_expired);
  // The holder whose renewal was lost goes on.
  CHECK(f.renew(lost, 30).ok());
}

TEST_CASE("after renewals checkpoints run on the checkpointer and the log stays bounded", "[store][durability]") {
  test::TempDir dir("mep-checkpoints");
  Fixture f(dir.path / "c.db", 4000); // servers: 32,000
  std::vector<lease::Grant> leases;
  for (int i = 0; i < 150; ++i) leases.push_back(f.claim("Lease" + std::to_string(i), 60));
  RenewBatch batch;
  batch.owner_client_id = "";
  for (const auto& g : leases) batch.leases.push_back(f.ref(g, 60));
  auto& metrics = Metrics::global();
  const double by_thread = metrics.value("mep_sqlite_checkpoints_total", "by=\"checkpointer\"");
  std::uintmax_t largest = 0;
  std::error_code ec;
  // Each renew-batch rewrites every page of the leases and of their expiry index, a dozen
  // or more: some 20,000 frames in all, four times the bound below.
  for (int i = 0; i < 1500; ++i) {
    auto out =
        test::wait_outcome<lease::RenewBatchResult>([&](auto then) { f.store->renew_batch(f.ctx, batch, then); });
    REQUIRE(out.ok());
    REQUIRE(out.value->results.size() == leases.size());
    REQUIRE(out.value->results.front().status == 200);
    largest = std::max(largest, std::filesystem::file_size(f.path.string() + "-wal", ec));
  }
  CHECK(metrics.value("mep_sqlite_checkpoints_total", "by=\"checkpointer\"") > by_thread);
  // 4,000 frames where the writer checkpoints itself; when that finds the checkpointer at
  // work (busy) it tries again 1,000 frames later (on_wal_commit), and the log restarts
  // after the batch that crossed that mark (5,008 frames seen on a loaded machine). Allowed
  // for: two such retries, a batch's frames and the headers. Without the checkpoints the
  // log would pass 20,000 frames.
  const std::uintmax_t frame = 4096 + 24;
  INFO("the log's largest size: " << largest << " bytes");
  CHECK(largest <= (4000 + 2 * 1000 + 64) * frame + 32);
}

TEST_CASE("after synced commits the writer checkpoints the log itself", "[store][durability]") {
  // Its file is then written over in place; claims ran slower when another thread alone
  // checkpointed and the log grew. The checkpointer copies pages meanwhile, every 1,000
  // frames, so that the writer's own checkpoint (at 4,000) finds little left to copy.
  test::TempDir dir("mep-checkpoints-synced");
  Fixture f(dir.path / "s.db");
  auto& metrics = Metrics::global();
  const double by_writer = metrics.value("mep_sqlite_checkpoints_total", "by=\"writer\"");
  const double by_thread = metrics.value("mep_sqlite_checkpoints_total", "by=\"checkpointer\"");
  std::uintmax_t largest = 0;
  std::error_code ec;
  // Each claim (and its memory's registration) writes a handful of pages: some 9,000
  // frames in all.
  for (int i = 0; i < 900; ++i) {
    f.claim("Synced" + std::to_string(i), 30);
    largest = std::max(largest, std::filesystem::file_size(f.path.string() + "-wal", ec));
  }
  CHECK(metrics.value("mep_sqlite_checkpoints_total", "by=\"writer\"") > by_writer);
  // The checkpointer is woken, not waited for: it has run by now, or does soon.
  for (int i = 0; i < 500 && metrics.value("mep_sqlite_checkpoints_total", "by=\"checkpointer\"") == by_thread; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(metrics.value("mep_sqlite_checkpoints_total", "by=\"checkpointer\"") > by_thread);
  INFO("the log's largest size: " << largest << " bytes");
  CHECK(largest <= 4100 * (4096 + 24) + 32);
}
