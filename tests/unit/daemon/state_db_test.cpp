// mepd's state database (daemon/state_db.cpp) under writes from many threads at once: the
// writes share transactions (group commit), and each one is there when its call returns;
// a write that fails takes back only its own changes, not those of the writes it shared a
// transaction with.
#include "mep/state_db.hpp"

#include "mep/sqlite.hpp"

#include <catch2/catch.hpp>
#include <sqlite3.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <set>
#include <thread>
#include <unistd.h>
#include <vector>

using namespace mep::daemon;
namespace fs = std::filesystem;

namespace {

// A VFS in front of the default one that counts xSync calls (the fsyncs SQLite asks for),
// made the default while a test runs.
struct CountingVfs {
  struct File {
    sqlite3_file base;
    sqlite3_file* real() { return reinterpret_cast<sqlite3_file*>(this + 1); }
  };
  static inline sqlite3_vfs* s_base = nullptr;
  static inline std::atomic<int> s_syncs{0};
  static inline sqlite3_io_methods s_methods{};
  sqlite3_vfs vfs{};

  static sqlite3_file* real(sqlite3_file* f) { return reinterpret_cast<File*>(f)->real(); }
  static const sqlite3_io_methods* m(sqlite3_file* f) { return real(f)->pMethods; }

  CountingVfs() {
    s_base = sqlite3_vfs_find(nullptr);
    vfs = *s_base;
    vfs.zName = "counting";
    vfs.szOsFile = static_cast<int>(sizeof(File)) + s_base->szOsFile;
    vfs.xOpen = [](sqlite3_vfs*, sqlite3_filename name, sqlite3_file* f, int flags, int* out) {
      int rc = s_base->xOpen(s_base, name, reinterpret_cast<File*>(f)->real(), flags, out);
      f->pMethods = rc == SQLITE_OK ? &s_methods : nullptr;
      return rc;
    };
    s_methods.iVersion = 3;
    s_methods.xClose = [](sqlite3_file* f) { return m(f)->xClose(real(f)); };
    s_methods.xRead = [](sqlite3_file* f, void* b, int n, sqlite3_int64 o) { return m(f)->xRead(real(f), b, n, o); };
    s_methods.xWrite = [](sqlite3_file* f, const void* b, int n, sqlite3_int64 o) {
      return m(f)->xWrite(real(f), b, n, o);
    };
    s_methods.xTruncate = [](sqlite3_file* f, sqlite3_int64 n) { return m(f)->xTruncate(real(f), n); };
    s_methods.xSync = [](sqlite3_file* f, int flags) {
      s_syncs++;
      return m(f)->xSync(real(f), flags);
    };
    s_methods.xFileSize = [](sqlite3_file* f, sqlite3_int64* n) { return m(f)->xFileSize(real(f), n); };
    s_methods.xLock = [](sqlite3_file* f, int l) { return m(f)->xLock(real(f), l); };
    s_methods.xUnlock = [](sqlite3_file* f, int l) { return m(f)->xUnlock(real(f), l); };
    s_methods.xCheckReservedLock = [](sqlite3_file* f, int* r) { return m(f)->xCheckReservedLock(real(f), r); };
    s_methods.xFileControl = [](sqlite3_file* f, int op, void* a) { return m(f)->xFileControl(real(f), op, a); };
    s_methods.xSectorSize = [](sqlite3_file* f) { return m(f)->xSectorSize(real(f)); };
    s_methods.xDeviceCharacteristics = [](sqlite3_file* f) { return m(f)->xDeviceCharacteristics(real(f)); };
    s_methods.xShmMap = [](sqlite3_file* f, int i, int n, int e, void volatile** p) {
      return m(f)->xShmMap(real(f), i, n, e, p);
    };
    s_methods.xShmLock = [](sqlite3_file* f, int o, int n, int fl) { return m(f)->xShmLock(real(f), o, n, fl); };
    s_methods.xShmBarrier = [](sqlite3_file* f) { m(f)->xShmBarrier(real(f)); };
    s_methods.xShmUnmap = [](sqlite3_file* f, int d) { return m(f)->xShmUnmap(real(f), d); };
    s_methods.xFetch = [](sqlite3_file* f, sqlite3_int64 o, int n, void** p) { return m(f)->xFetch(real(f), o, n, p); };
    s_methods.xUnfetch = [](sqlite3_file* f, sqlite3_int64 o, void* p) { return m(f)->xUnfetch(real(f), o, p); };
    sqlite3_vfs_register(&vfs, 1);
  }
  ~CountingVfs() {
    sqlite3_vfs_unregister(&vfs);
    sqlite3_vfs_register(s_base, 1);
  }
  int syncs() const { return s_syncs.load(); }
};

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/mep-statedb-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

Intent intent(const std::string& key) {
  Intent in;
  in.key = key;
  in.request.display_name = "agent-" + key;
  in.request.memory_id = "mem-" + key;
  in.request.owner_client_id = "owner";
  in.request.ttl_s = 30;
  in.path = "/tmp/" + key + ".uai";
  in.bind_pid = 0;
  return in;
}

// A regular file's stat: device 1, inode 100.
FileStat a_file() {
  FileStat st;
  st.dev = 1;
  st.ino = 100;
  st.regular = true;
  return st;
}

SavedLease lease(const std::string& name) {
  SavedLease l;
  l.canonical_name = name;
  l.display_name = name;
  l.memory_id = "mem-" + name;
  l.lease_id = "lease-" + name;
  l.owner_client_id = "owner";
  l.fencing_token = 1;
  l.ttl_s = 30;
  l.expires_at = 1'000'000;
  l.path = "/tmp/" + name + ".uai";
  return l;
}

} // namespace

TEST_CASE("concurrent writes are each durable when they return, and fail alone") {
  TempDir dir;
  const fs::path db = dir.path / "mepd.db";
  constexpr int k_threads = 32;
  constexpr int k_rounds = 40;
  std::atomic<int> duplicates_refused{0};
  {
    StateDb state(db);
    std::vector<std::thread> threads;
    std::atomic<int> ready{0};
    for (int t = 0; t < k_threads; ++t)
      threads.emplace_back([&, t] {
        ++ready;
        while (ready.load() < k_threads) std::this_thread::yield();
        for (int r = 0; r < k_rounds; ++r) {
          const std::string key = std::to_string(t) + "-" + std::to_string(r);
          state.add_intent(intent(key));
          // The same key again is a constraint failure: this write fails, and the writes
          // that share its transaction do not.
          try {
            state.add_intent(intent(key));
          } catch (const mep::sqlite::Error&) {
            ++duplicates_refused;
          }
          state.save_lease(lease("n" + key));
          if (r % 2 == 0) {
            state.delete_intent(key);
            state.forget_lease("n" + key);
          }
        }
      });
    for (auto& th : threads) th.join();
  }
  CHECK(duplicates_refused.load() == k_threads * k_rounds);
  // Reopened, as after a restart: exactly the writes that returned.
  StateDb state(db);
  std::set<std::string> intents, leases;
  for (const auto& in : state.intents()) intents.insert(in.key);
  for (const auto& l : state.leases()) leases.insert(l.canonical_name);
  std::set<std::string> want_intents, want_leases;
  for (int t = 0; t < k_threads; ++t)
    for (int r = 1; r < k_rounds; r += 2) {
      const std::string key = std::to_string(t) + "-" + std::to_string(r);
      want_intents.insert(key);
      want_leases.insert("n" + key);
    }
  CHECK(intents == want_intents);
  CHECK(leases == want_leases);
}

TEST_CASE("a renewal batch's expiries are written together") {
  TempDir dir;
  StateDb state(dir.path / "mepd.db");
  for (const char* n : {"a", "b", "c"}) state.save_lease(lease(n));
  state.save_expiries({{"a", 2'000'000}, {"c", 3'000'000}, {"gone", 4'000'000}});
  std::map<std::string, std::int64_t> got;
  for (const auto& l : state.leases()) got[l.canonical_name] = l.expires_at;
  CHECK(got == std::map<std::string, std::int64_t>{{"a", 2'000'000}, {"b", 1'000'000}, {"c", 3'000'000}});
}

TEST_CASE("a file's record is rewritten when what it says changes, and only then") {
  // remember_file skips the write when the row already says the same (most detaches): the
  // skip must never keep a changed memory, inode, birth time, owner or fingerprint out.
  TempDir dir;
  StateDb db(dir.path / "state.db");
  const uid_t me = ::getuid();
  FileStat st = a_file();
  st.birth_ns = 5;
  auto content = [&](const std::string& sha) { return db.memories_by_content(sha, me); };
  db.remember_file("mem-a", "/f.uai", st, std::string("sha-1"), me);
  CHECK(content("sha-1") == std::vector<std::string>{"mem-a"});
  db.remember_file("mem-a", "/f.uai", st, std::nullopt, me); // no new fingerprint: the old one stays
  CHECK(content("sha-1") == std::vector<std::string>{"mem-a"});
  db.remember_file("mem-a", "/f.uai", st, std::string("sha-1"), me); // the same: skipped
  CHECK(content("sha-1") == std::vector<std::string>{"mem-a"});
  db.remember_file("mem-a", "/f.uai", st, std::string("sha-2"), me); // the bytes changed
  CHECK(content("sha-1").empty());
  CHECK(content("sha-2") == std::vector<std::string>{"mem-a"});
  FileStat moved = st;
  moved.ino = 101; // the path now names another inode
  db.remember_file("mem-a", "/f.uai", moved, std::nullopt, me);
  CHECK(db.memory_by_inode(moved, me) == std::optional<std::string>("mem-a"));
  CHECK(!db.memory_by_inode(st, me));
  FileStat reborn = moved;
  reborn.birth_ns = 6; // the same inode number, another file
  db.remember_file("mem-a", "/f.uai", reborn, std::nullopt, me);
  CHECK(db.memory_by_inode(reborn, me) == std::optional<std::string>("mem-a"));
  CHECK(!db.memory_by_inode(moved, me));
  db.remember_file("mem-b", "/f.uai", reborn, std::nullopt, me); // another memory at that path
  CHECK(db.memory_by_inode(reborn, me) == std::optional<std::string>("mem-b"));
  CHECK(content("sha-2").empty()); // a fingerprint is not carried over to another memory
  db.remember_file("mem-b", "/f.uai", reborn, std::nullopt, me + 1); // made for another user
  CHECK(!db.memory_by_inode(reborn, me));
  CHECK(db.memory_by_inode(reborn, me + 1) == std::optional<std::string>("mem-b"));
}

TEST_CASE("a lease's save and delete are written without an fsync, an intent with one") {
  TempDir dir;
  const auto path = dir.path / "mepd.db";
  {
    CountingVfs vfs;
    StateDb db(path);
    int before = vfs.syncs();
    db.add_intent(intent("a")); // before the claim leaves: durable
    CHECK(vfs.syncs() > before);
    before = vfs.syncs();
    db.save_lease(lease("a"), "a"); // the row and the intent's delete: lazy
    db.save_lease(lease("b"));
    db.forget_lease("a");
    CHECK(vfs.syncs() == before);
    db.forget_lease("b", "lease-b", Sync::durable); // a release that did not reach the server
    CHECK(vfs.syncs() > before);
    before = vfs.syncs();
    // A delete that names another lease id keeps the row (a grant that replaced it).
    db.save_lease(lease("c"));
    db.forget_lease("c", "lease-of-an-older-grant");
    CHECK(vfs.syncs() == before);
    CHECK(db.leases().size() == 1);
    CHECK(db.intents().empty());
  }
  // Lazy writes are committed all the same: the database opened again (a restart) has them.
  StateDb again(path);
  auto rows = again.leases();
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].canonical_name == "c");
  CHECK(again.intents().empty());
}

TEST_CASE("a file's record known from a check is not trusted after a write changed it") {
  // remember_file keeps what its check found in memory; a write in between must not leave
  // the old row believed, or writing it back would be skipped.
  TempDir dir;
  StateDb db(dir.path / "state.db");
  const uid_t me = ::getuid();
  const FileStat st = a_file();
  db.remember_file("mem-a", "/f.uai", st, std::string("sha-1"), me); // written
  db.remember_file("mem-a", "/f.uai", st, std::string("sha-1"), me); // checked: known
  db.remember_file("mem-b", "/f.uai", st, std::nullopt, me);         // another memory there
  CHECK(db.memory_by_inode(st, me) == std::optional<std::string>("mem-b"));
  db.remember_file("mem-a", "/f.uai", st, std::string("sha-1"), me); // and back
  CHECK(db.memory_by_inode(st, me) == std::optional<std::string>("mem-a"));
  CHECK(db.memories_by_content("sha-1", me) == std::vector<std::string>{"mem-a"});
  // Registration, known once seen, whoever wrote it.
  CHECK(!db.registered("mem-a"));
  {
    StateDb other(dir.path / "state.db");
    other.mark_registered("mem-a");
  }
  CHECK(db.registered("mem-a"));
  db.mark_registered("mem-b");
  CHECK(db.registered("mem-b"));
}
