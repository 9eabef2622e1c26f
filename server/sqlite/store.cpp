// The embedded SQLite store (SPEC §9): one writer thread committing concurrent
// requests in groups, read-only connections for reads and authentication. This file holds
// the store's machinery (the lease clock, the writer and its batches, checkpoints, audit,
// renewals from memory); the schema, the rows, the operations and the reads are in the
// other files here.
//
// Design notes.
// * Durability: WAL with synchronous=FULL, so COMMIT returns after fsync. Every outcome
//   of a batch is handed over only after its COMMIT (writer_loop/run_batch): an
//   acknowledged grant survives a power loss, and a fencing token is never issued twice.
//   A batch of renewals alone commits without its fsync; the lease clock's checkpoint
//   makes good after a reboot what it may lose (see "Renewals" at anchor_clock).
// * After renewals, checkpoints run on a thread of their own, not on the writer
//   (on_wal_commit).
// * Group commit: run_batch opens one BEGIN IMMEDIATE transaction for all queued jobs
//   and commits once. Jobs run without savepoints; one that fails after writing sends
//   the batch to a second pass with a SAVEPOINT per job, so it rolls back alone.
//   Jobs run one at a time, so concurrent duplicates of one Idempotency-Key serialize.
// * Transitions of SPEC §4, by function: register (op_register), claim and takeover
//   (op_claim: expired rows conflicting on name, skeleton or memory are deleted with
//   the grant, §12.2, or rewritten when they are the claimed memory's row under the same
//   name), renew (op_renew: expiry = max(old, now+ttl)), release (release: the row stays,
//   marked released — expires_at = 0, see k_released), expiry (the clock; sweep removes
//   the rows later), branch (branch), revoke (revoke).
// * Fencing: the counter lives on the memory row (§12.1) and only grows; classify()
//   compares a presented token with the lease row *and* that counter, so a superseded
//   token (409) is told from an expired lease (410) even after the row is gone.
// * Idempotency (run_idempotent): keyed by (tenant, key) (§12.3); the outcome is stored
//   (stored_outcome.hpp: the API's status and body) in the same transaction as the
//   operation; definite refusals are stored (with nothing of the operation: it wrote
//   nothing, or its savepoint was rolled back), failures whose outcome may be unknown
//   (outcome_may_be_unknown: retry, unreachable, internal kinds) never. A replay reads it
#include "internal.hpp"
//   back into the typed outcome.

#include "mep/crypto.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/random.hpp"
#include "mep/uuid.hpp"
#include "mep/rows.hpp"
#include "mep/stored_outcome.hpp"

#include <boost/json/array.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <pthread.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
namespace mep::server {
namespace {

using namespace sqlite_rows;

constexpr std::size_t k_max_group = 1024;
// The log's growth that wakes the checkpointer (SQLite's own default; see on_wal_commit);
// the length at which the writer checkpoints the log itself after a synced commit; and the
// size its file is cut back to when it starts again: above what synced commits leave
// (about 4,000 frames of 4 KiB), which are then written over in place, never cut and grown
// again (cycles at 8 and 64 clients ran 10 % slower with 4 MiB).
constexpr int k_wal_checkpoint_frames = 1000;
constexpr int k_wal_synced_frames = 4000;
// How long renewals answered from memory wait before they are written, at most, when no
// other request comes (see "Renewals from memory").
constexpr auto k_flush_delay = std::chrono::milliseconds(50);

constexpr std::int64_t k_wal_kept_bytes = 16 << 20;

std::string db_path_from_url(const std::string& url) {
  if (url.rfind("sqlite://", 0) == 0) return url.substr(9);
  if (url.rfind("sqlite:", 0) == 0) return url.substr(7);
  return url;
}

// Returns `path`; unless `create`, throws when no file is there.
std::string existing_unless(bool create, std::string path) {
  std::error_code ec;
  if (!create && !path.empty() && !std::filesystem::exists(path, ec))
    throw std::runtime_error(fmt::format("no database at {} (`mep token create` creates one)", path));
  return path;
}

// Creates the database's directory (0700) when it is missing, before any file beside
// the database is opened. Returns `path`.
std::string with_parent_directory(std::string path) {
  if (path.empty()) throw std::runtime_error("empty SQLite database path");
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    if (!std::filesystem::exists(parent, ec)) {
      std::filesystem::create_directories(parent, ec);
      if (ec) throw std::runtime_error("cannot create " + parent.string() + ": " + ec.message());
      ::chmod(parent.c_str(), 0700);
    }
  }
  return path;
}

// Takes PATH-serving.lock; throws when another process holds it.
int lock_serving(const std::string& path) {
  const int fd = try_lock_beside(path, "-serving.lock");
  if (fd < 0)
    throw std::runtime_error(fmt::format("another process (mep server, or mepd with its embedded control plane) is "
                                         "serving {}; SQLite serves one process only: stop it, or use PostgreSQL for "
                                         "several servers",
                                         path));
  return fd;
}

} // namespace

// ---- the lease clock ---------------------------------------------------------------------
//
// Expiry is decided on m_clock, never on the wall clock (SPEC §9), so a step of the wall
// clock neither shortens nor stretches a lease. Once a second (with the sweep) the clock's
// reading is saved with CLOCK_BOOTTIME and the boot id. A restart within the same boot
// goes on from that reading plus the boot time since, wall-clock steps while down
// included; after a reboot (a new boot id) the clock starts from the wall clock, but never
// below the saved reading, and every lease live at the saved reading keeps at least the
// time it had left then (leases are extended conservatively, as etcd's new leader does),
// and at least its TTL from the start.
//
// Renewals. A batch of nothing but renewals commits at synchronous=NORMAL: written to the
// log, not synced (run_batch). A process that crashes loses nothing of it (the kernel
// holds the writes); a reboot (power loss, a kernel crash) may lose renewals committed
// after the last sync. Every clock checkpoint is synced (the sweep's batch is never lazy),
// so a lost renewal ran after the last saved checkpoint, on a lease unexpired then: its
// row on disk is live at the saved reading, and after the reboot it keeps at least its
// TTL from the start, which ends after any expiry a lost renewal promised (a renewal that
// raises the TTL is synced before it is answered, so the TTL on disk is at least that of
// any lost renewal). Nobody else is granted the name before an acknowledged expiry, as
// SPEC §9 asks; the price is that after a reboot a dead holder's lease lasts up to one TTL
// longer. What it saves is an fsync per batch of renewals, and with it the stalls that
// come with each on a busy disk.
//
// Renewals from memory. A serving store answers most renewals without the writer: once
// the writer has renewed a lease (op_renew), it hands the lease to m_renewals, and later
// renewals with the same token, tenant, name, owner and TTL are answered there by the
// I/O thread (renew_from_memory), expiry = max(old, now + TTL) as op_renew would. The
// database is told afterwards: the first such renewal wakes the writer, whose next batch
// writes every expiry renewed since (flush_renewals, unsynced when nothing else is in the
// batch). Two rules keep this safe:
// * A lease is either in m_renewals or the writer's. Before the writer reads a lease row
//   to act on it (classify, op_claim's conflicts, revoke, the sweep) it takes the lease out
//   (settle), with a later expiry than the row's written back first; a renewal that comes
//   after that misses and goes to the writer. So the writer never ends a lease on an
//   expiry that a renewal from memory has moved, and no renewal from memory lands on a
//   lease the writer ended. What a transaction takes and hands over is undone with it.
// * A process that ends without flushing (a crash, kill -9) loses renewals it answered.
//   The clock checkpoint is saved with the clock's reading at its batch's flush, so such a
//   renewal came after the last checkpoint, on a lease whose row is live at it. A serving
//   store marks the database while it serves and clears the mark when it stops (after a
//   last, synced flush); started on a marked database in the same boot, it gives every
//   lease live at the checkpoint at least its TTL from the start, which ends after any
//   expiry a lost renewal promised (renewals from memory keep the TTL on disk). After a
//   reboot the rule above does the same. The price, as for lost lazy commits: after a
//   crash, a dead holder's lease may last up to one TTL longer.
// Readers (get_lease, list_leases) see m_renewals' expiries over the rows'.

namespace {
constexpr std::string_view k_clock_key = "lease_clock_checkpoint";
// Present while a process serves the database (see "Renewals from memory").
constexpr std::string_view k_serving_key = "serving";
} // namespace

void SqliteStore::anchor_clock() {
  std::optional<UnixMs> saved_ms;
  std::int64_t saved_boot_ms = 0;
  std::string saved_boot;
  {
    Use s(m_db->prepare("SELECT value FROM settings WHERE key = ?1"));
    s->bind(1, k_clock_key);
    if (s->step()) {
      char boot[64] = {0};
      long long ms = 0, bms = 0;
      if (std::sscanf(s->text(0).c_str(), "%lld %lld %63s", &ms, &bms, boot) == 3) {
        saved_ms = ms;
        saved_boot_ms = bms;
        saved_boot = boot;
      }
    }
  }
  bool crashed = false; // the last process that served it ended without its last flush
  if (m_serving) {
    Use s(m_db->prepare("SELECT 1 FROM settings WHERE key = ?1"));
    s->bind(1, k_serving_key);
    crashed = s->step();
  }
  if (!saved_ms) { // a new database: the wall clock it is, saved at once (see "Renewals")
    save_clock_checkpoint(*m_db, {m_clock.now(), boot_ms()});
    return;
  }
  const std::string boot = boot_id();
  if (!boot.empty() && boot == saved_boot) {
    const std::int64_t since = std::max<std::int64_t>(0, boot_ms() - saved_boot_ms);
    const UnixMs start = *saved_ms + since;
    m_clock = LeaseClock(start);
    if (!crashed) return;
    Use u(m_db->prepare("UPDATE leases SET expires_at = ?1 + ttl_seconds * 1000 "
                        "WHERE expires_at > ?2 AND ?1 + ttl_seconds * 1000 > expires_at"));
    u->bind(1, start).bind(2, *saved_ms).run();
    if (m_db->changes() > 0)
      log::info("the last server of this database did not stop cleanly: {} leases live at the last clock "
                "checkpoint keep at least their TTL",
                m_db->changes());
    return;
  }
  const UnixMs start = std::max(now_unix_ms(), *saved_ms);
  m_clock = LeaseClock(start);
  Use u(m_db->prepare("UPDATE leases SET expires_at = max(?1 + (expires_at - ?2), ?1 + ttl_seconds * 1000) "
                      "WHERE expires_at > ?2 AND max(?1 + (expires_at - ?2), ?1 + ttl_seconds * 1000) > expires_at"));
  u->bind(1, start).bind(2, *saved_ms).run();
  if (m_db->changes() > 0)
    log::info("after a reboot: {} leases live at the last clock checkpoint keep the time they had left then, "
              "and at least their TTL",
              m_db->changes());
}

void SqliteStore::save_clock_checkpoint(Db& db, std::pair<UnixMs, std::int64_t> at) {
  Use s(db.prepare("INSERT INTO settings(key, value) VALUES (?1, ?2) "
                   "ON CONFLICT(key) DO UPDATE SET value = excluded.value"));
  s->bind(1, k_clock_key).bind(2, fmt::format("{} {} {}", at.first, at.second, boot_id())).run();
}

// ---- construction and the writer -------------------------------------------------------

SqliteStore::SqliteStore(const std::string& url, bool create, int writer_nice, bool serving, int wal_writer_frames)
    : m_path(with_parent_directory(existing_unless(create, db_path_from_url(url)))),
      m_wal_writer_frames(std::max(wal_writer_frames, k_wal_checkpoint_frames)), m_writer_nice(writer_nice),
      m_tokens(m_path + "-token-epoch") {
  // SQLite serves one process: a second server on the same file would hand out the same
  // grants' state from two group-commit writers that know nothing of each other's caches.
  // Short commands (mep token, mep migrate) do not serve and may run beside it.
  if (serving) m_serving_lock = lock_serving(m_path);
  m_serving = serving;
  m_db = std::make_unique<Db>(m_path, sqlite::Mode::read_write_create);
  m_db->exec("PRAGMA journal_mode=WAL");
  m_db->exec("PRAGMA synchronous=FULL");
  m_db->exec("PRAGMA foreign_keys=ON");
  m_db->exec("PRAGMA cache_size=-8000");
  m_db->exec(fmt::format("PRAGMA journal_size_limit={}", k_wal_kept_bytes));
  ::chmod(m_path.c_str(), 0600);
  migrate();
  refresh_migration_state(*m_db);
  anchor_clock();
  if (m_serving) { // synced (synchronous=FULL): a crash from here on is seen at the next start
    Use s(m_db->prepare("INSERT INTO settings(key, value) VALUES (?1, '1') ON CONFLICT(key) DO NOTHING"));
    s->bind(1, k_serving_key).run();
  }
  m_checkpoint_db = std::make_unique<Db>(m_path, sqlite::Mode::read_write_create);
  m_checkpoint_db->exec("PRAGMA synchronous=FULL");
  ::sqlite3_wal_hook(m_db->handle(), &SqliteStore::on_wal_commit, this); // replaces SQLite's own checkpoints
  m_checkpointer = std::thread([this] { checkpoint_loop(); });
  m_writer = std::thread([this] { writer_loop(); });
}

SqliteStore::~SqliteStore() {
  {
    std::lock_guard lock(m_mutex);
    m_stopping = true;
  }
  m_cv.notify_all();
  if (m_writer.joinable()) m_writer.join();
  {
    std::lock_guard lock(m_checkpoint_mutex);
    m_checkpoint_stopping = true;
  }
  m_checkpoint_cv.notify_all();
  if (m_checkpointer.joinable()) m_checkpointer.join();
  if (m_serving_lock >= 0) ::close(m_serving_lock);
}

int try_lock_beside(const std::string& db_path, std::string_view suffix) {
  const std::string lock = with_parent_directory(db_path) + std::string(suffix);
  int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", lock, std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) return -1;
    throw std::runtime_error(fmt::format("cannot lock {}: {}", lock, std::strerror(err)));
  }
  return fd;
}

void SqliteStore::enqueue(Work work, Finish done, std::string request_id, bool careful, bool lazy) {
  {
    std::unique_lock lock(m_mutex);
    if (m_refusing) {
      const Problem why = *m_refusing;
      lock.unlock();
      return done(why);
    }
    m_queue.push_back(Job{std::move(work), std::move(done), std::move(request_id), careful, lazy});
  }
  m_cv.notify_one();
}

void SqliteStore::refuse_queued(const Problem& why) {
  std::deque<Job> refused;
  {
    std::lock_guard lock(m_mutex);
    m_refusing = why;
    refused.swap(m_queue);
  }
  if (!refused.empty()) log::info("refused {} queued database operations: {}", refused.size(), why.detail);
  for (Job& job : refused) {
    try {
      job.done(why);
    } catch (const std::exception& e) {
      log::error("request {}: answering failed: {}", job.request_id, e.what());
    }
  }
}

void SqliteStore::writer_loop() {
  ::pthread_setname_np(::pthread_self(), "mep-writer");
  // Every request waits for this thread, which sleeps in each commit's fdatasync. Woken,
  // it competes for a CPU with the I/O threads and with the clients on the same machine;
  // with a higher priority it runs at once, and batches follow each other sooner.
  if (m_writer_nice != 0) {
    errno = 0;
    const int own = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
    if (errno == 0) m_own_nice = own;
    if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), m_writer_nice) == 0) {
      log::debug("the commit thread runs at nice {}", m_writer_nice);
      m_nice_switch = m_own_nice.has_value() && m_writer_nice < *m_own_nice;
    } else
      log::debug("the commit thread keeps its priority: nice {}: {}", m_writer_nice, std::strerror(errno));
  }
  std::vector<Job> batch;
  for (;;) {
    {
      std::unique_lock lock(m_mutex);
      m_cv.wait(lock, [&] { return !m_queue.empty() || m_stopping || m_flush_wanted; });
      // Renewals from memory alone wait a little for more, and for requests to flush with:
      // a lease renewed again meanwhile is written once.
      if (m_queue.empty() && !m_stopping)
        m_cv.wait_for(lock, k_flush_delay, [&] { return !m_queue.empty() || m_stopping; });
      if (m_queue.empty() && m_stopping) break;
      m_flush_wanted = false; // an empty batch flushes m_renewals all the same
      std::size_t n = std::min(m_queue.size(), k_max_group);
      batch.assign(std::make_move_iterator(m_queue.begin()),
                   std::make_move_iterator(m_queue.begin() + static_cast<std::ptrdiff_t>(n)));
      m_queue.erase(m_queue.begin(), m_queue.begin() + static_cast<std::ptrdiff_t>(n));
    }
    run_batch(batch);
    batch.clear();
  }
  stop_serving();
}

void SqliteStore::stop_serving() {
  if (!m_serving) return;
  std::vector<Job> last;
  last.push_back(Job{[](Db& db, UnixMs) {
                       Use s(db.prepare("DELETE FROM settings WHERE key = ?1"));
                       s->bind(1, k_serving_key).run();
                     },
                     [](std::optional<Problem> failure) {
                       if (failure) log::warn("the last renewals could not be written: the next start extends leases");
                     },
                     {},
                     /*careful=*/true,
                     /*lazy=*/false});
  m_complete = nullptr; // the I/O threads may be gone: answered here
  m_renewals.close();   // a renewal from here on goes to the (stopped) writer, not to memory
  run_batch(last);
}

// ---- checkpoints ----------------------------------------------------------------------------
//
// After a synced commit the writer checkpoints the log itself once it holds 4,000 frames:
// the log starts again from its beginning at the next transaction and its file is written
// over in place (claims at 8 clients ran 20 % slower when the log was left to grow and
// another thread checkpointed it: a synced commit that appends to a growing file costs the
// file system more, and the two threads' fsyncs meet). Meanwhile, each time the log has
// grown by k_wal_checkpoint_frames, a thread of its own checkpoints PASSIVE (it never blocks
// the writer or a reader): it copies most of the log's pages into the database while the
// writer goes on, so the writer's own checkpoint finds little left to copy. (At 1,000
// frames and done by the writer alone, checkpoints took 19 % of the writer's time in fresh
// claims at 64 clients; see bench/README.md for the A/B.)
// After a commit that was not synced (renewals), copying pages and two fsyncs (the log's,
// then the database file's) would be most of the writer's time: only that thread
// checkpoints then. A passive checkpoint beside a busy writer never catches the end of the
// log, so it does not start again; the writer checkpoints itself at the next synced commit
// past 4,000 frames, or when the log reaches m_wal_writer_frames (32,000 frames, 128 MiB):
// the log stays bounded. Should a reader keep it from starting again, the writer tries again
// k_wal_checkpoint_frames later. When it starts again the file is cut back to 16 MiB.

int SqliteStore::on_wal_commit(void* self_, sqlite3* db, const char* schema, int frames) {
  auto* self = static_cast<SqliteStore*>(self_);
  if (frames < self->m_wal_frames) { // the log started again
    self->m_wal_asked = 0;
    self->m_wal_retry_at = 0;
  }
  self->m_wal_frames = frames;
  const int limit = self->m_lazy_commits ? self->m_wal_writer_frames : k_wal_synced_frames;
  if (frames >= std::max(limit, self->m_wal_retry_at)) {
    int rc = ::sqlite3_wal_checkpoint_v2(db, schema, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr);
    if (rc != SQLITE_OK && rc != SQLITE_BUSY) log::warn("checkpoint failed: {}", ::sqlite3_errstr(rc));
    Metrics::global().inc("mep_sqlite_checkpoints_total", "by=\"writer\"");
    self->m_wal_retry_at = frames + k_wal_checkpoint_frames;
    self->m_wal_asked = frames;
  } else if (frames - self->m_wal_asked >= k_wal_checkpoint_frames) {
    self->m_wal_asked = frames;
    {
      std::lock_guard lock(self->m_checkpoint_mutex);
      self->m_checkpoint_wanted = true;
    }
    self->m_checkpoint_cv.notify_one();
  }
  return SQLITE_OK;
}

void SqliteStore::checkpoint_loop() {
  ::pthread_setname_np(::pthread_self(), "mep-checkpoint");
  for (;;) {
    {
      std::unique_lock lock(m_checkpoint_mutex);
      m_checkpoint_cv.wait(lock, [&] { return m_checkpoint_wanted || m_checkpoint_stopping; });
      if (m_checkpoint_stopping) return;
      m_checkpoint_wanted = false;
    }
    try {
      int rc =
          ::sqlite3_wal_checkpoint_v2(m_checkpoint_db->handle(), nullptr, SQLITE_CHECKPOINT_PASSIVE, nullptr, nullptr);
      if (rc == SQLITE_OK)
        Metrics::global().inc("mep_sqlite_checkpoints_total", "by=\"checkpointer\"");
      else if (rc != SQLITE_BUSY) // the writer checkpoints itself when the log grows long
        log::warn("checkpoint failed: {}", ::sqlite3_errmsg(m_checkpoint_db->handle()));
    } catch (const std::exception& e) {
      log::error("checkpointer: {}", e.what());
    }
  }
}

// Makes the last commit durable as synchronous=FULL would have: syncs the log, through
// SQLite's own handle of it.
void SqliteStore::sync_wal() {
  sqlite3_file* wal = nullptr;
  int rc = ::sqlite3_file_control(m_db->handle(), "main", SQLITE_FCNTL_JOURNAL_POINTER, &wal);
  if (rc == SQLITE_OK && (!wal || !wal->pMethods)) rc = SQLITE_IOERR_FSYNC;
  if (rc == SQLITE_OK) rc = wal->pMethods->xSync(wal, SQLITE_SYNC_NORMAL);
  if (rc != SQLITE_OK) throw sqlite::Error(rc, std::string("cannot sync the log: ") + ::sqlite3_errstr(rc));
}

// A batch first runs optimistically: no savepoints. Each job's first change to a page
// inside a SAVEPOINT copies the page into SQLite's statement journal, and that copying
// was a fifth of the writer's time at 64 clients. Jobs check before they write (a claim
// finds its conflicts before it removes expired leases), so a job that must be undone is
// rare: one that throws (an I/O error, a bug) or an idempotent operation that fails
// after writing. Then the whole transaction is rolled back and the batch runs again,
// each job in its own SAVEPOINT as before. Nothing was acknowledged in between; counters
// that the first pass incremented for the jobs before the failing one count them twice.
void SqliteStore::run_batch(std::vector<Job>& batch) {
  std::vector<std::optional<Problem>> failures(batch.size());
  auto fail_batch = [&] {
    m_renewals.rolled_back();
    m_healthy = false;
    for (auto& job : batch) job.done(db_unavailable());
  };
  bool careful = std::any_of(batch.begin(), batch.end(), [](const Job& j) { return j.careful; });
  // A batch of renewals only commits without its fsync (see "Renewals" in the notes on
  // the lease clock); the level can only change between transactions. Such a commit
  // waits for no disk, so the writer keeps no higher priority than the I/O threads then.
  const bool lazy = std::all_of(batch.begin(), batch.end(), [](const Job& j) { return j.lazy; });
  if (lazy != m_lazy_commits) {
    try {
      Use(m_db->prepare(lazy ? "PRAGMA synchronous=NORMAL" : "PRAGMA synchronous=FULL"))->run();
    } catch (const sqlite::Error& e) {
      log::error("database error: {}", e.what());
      return fail_batch();
    }
    m_lazy_commits = lazy;
    if (m_nice_switch) ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), lazy ? *m_own_nice : m_writer_nice);
  }
  m_must_sync = false;
  const auto began = std::chrono::steady_clock::now();
  for (;;) {
    try {
      Use(m_db->prepare("BEGIN IMMEDIATE"))->run(); // prepared once: no parsing per batch
    } catch (const sqlite::Error& e) {
      log::error("database error: {}", e.what());
      return fail_batch();
    }
    // The clock's reading before the flush: what a checkpoint saved in this batch holds
    // (see "Renewals from memory").
    m_flushed_at = {m_clock.now(), boot_ms()};
    Pass pass = Pass::done;
    try {
      flush_renewals(*m_db);
    } catch (const sqlite::Error& e) {
      log::error("database error: {}", e.what());
      pass = Pass::aborted; // the batch fails with it: rolled back below, renewals pending again
    }
    if (pass == Pass::done) pass = run_jobs(batch, failures, careful);
    // Requests that arrived while the batch ran join it before the COMMIT: one more fsync
    // shared instead of a batch of their own after this one's.
    for (std::size_t n; pass == Pass::done && (n = extend_batch(batch, careful, m_lazy_commits, began)) > 0;) {
      failures.resize(batch.size());
      pass = run_jobs(batch, failures, careful, batch.size() - n);
    }
    if (pass == Pass::done) break;
    if (!::sqlite3_get_autocommit(m_db->handle())) {
      try {
        m_db->exec("ROLLBACK");
      } catch (const sqlite::Error& e) {
        log::error("rollback failed: {}", e.what());
        pass = Pass::aborted;
      }
    }
    m_renewals.rolled_back();
    if (pass == Pass::aborted || careful) return fail_batch();
    log::debug("a batch of {} requests runs again, each in a savepoint", batch.size());
    careful = true;
  }
  try {
    auto started = std::chrono::steady_clock::now();
    Use(m_db->prepare("COMMIT"))->run();
    const bool deferred = m_lazy_commits && !m_must_sync;
    if (m_lazy_commits && m_must_sync) sync_wal();
    auto& metrics = Metrics::global();
    metrics.observe("mep_sqlite_commit_duration_seconds", {},
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    metrics.inc("mep_sqlite_commits_total", deferred ? "sync=\"deferred\"" : "sync=\"fsync\"");
    metrics.inc("mep_sqlite_committed_requests_total", {}, static_cast<double>(batch.size()));
    m_renewals.committed();
    m_healthy = true;
  } catch (const sqlite::Error& e) {
    log::error("commit failed: {}", e.what());
    try {
      m_db->exec("ROLLBACK");
    } catch (...) {}
    m_renewals.rolled_back();
    m_healthy = false;
    for (auto& f : failures) f = db_unavailable();
  }
  if (batch.empty()) return; // a flush alone
  if (m_complete) {
    // One hand-over for the whole batch (see Store::set_completion_executor): the replies
    // are rendered and written by the I/O threads, not here. run_sync's callers wait on
    // their own, maybe on an I/O thread: they are answered from here.
    std::vector<std::pair<Finish, std::optional<Problem>>> finished;
    finished.reserve(batch.size());
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if (batch[i].careful)
        batch[i].done(std::move(failures[i]));
      else
        finished.emplace_back(std::move(batch[i].done), std::move(failures[i]));
    }
    m_complete([finished = std::move(finished)]() mutable {
      for (auto& [done, failure] : finished) done(std::move(failure));
    });
    return;
  }
  for (std::size_t i = 0; i < batch.size(); ++i) batch[i].done(std::move(failures[i]));
}

// Takes waiting requests into the batch while it is open: at most k_max_group in all, for
// at most k_max_extension after the batch began (a steady stream must not hold back the
// COMMIT of the requests already run), and in an optimistic pass none that must run
// carefully (they wait for the next batch).
std::size_t SqliteStore::extend_batch(std::vector<Job>& batch, bool careful, bool lazy,
                                      std::chrono::steady_clock::time_point began) {
  constexpr auto k_max_extension = std::chrono::microseconds(250);
  if (std::chrono::steady_clock::now() - began > k_max_extension) return 0;
  std::lock_guard lock(m_mutex);
  std::size_t n = 0;
  while (!m_queue.empty() && batch.size() < k_max_group && (careful || !m_queue.front().careful) &&
         (!lazy || m_queue.front().lazy)) {
    batch.push_back(std::move(m_queue.front()));
    m_queue.pop_front();
    ++n;
  }
  return n;
}

SqliteStore::Pass SqliteStore::run_jobs(std::vector<Job>& batch, std::vector<std::optional<Problem>>& failures,
                                        bool careful, std::size_t from) {
  m_careful = careful;
  for (std::size_t i = from; i < batch.size(); ++i) {
    const std::int64_t before = m_db->total_changes();
    const RenewalTable::Mark mark = m_renewals.mark();
    try {
      if (careful) Use(m_db->prepare("SAVEPOINT job"))->run();
      m_pending_audit.clear();
      failures[i].reset();
      batch[i].work(*m_db, m_clock.now());
      write_pending_audit();
      if (careful) Use(m_db->prepare("RELEASE job"))->run();
    } catch (const NeedsCarefulRun&) {
      return Pass::run_carefully;
    } catch (const std::exception& e) {
      // After SQLITE_FULL, an I/O error or out-of-memory SQLite may have rolled the whole
      // transaction back: every earlier job of the batch is gone with it.
      if (::sqlite3_get_autocommit(m_db->handle())) {
        log::error("request {} failed and ended the transaction: {}", batch[i].request_id, e.what());
        return Pass::aborted;
      }
      if (!careful && m_db->total_changes() != before) return Pass::run_carefully; // logged then
      log::error("request {} failed: {}", batch[i].request_id, e.what());
      if (careful) {
        try {
          m_db->exec("ROLLBACK TO job; RELEASE job");
          m_renewals.undo_to(mark);
        } catch (const sqlite::Error& e2) {
          log::error("rollback of a request failed: {}", e2.what());
          return Pass::aborted;
        }
      }
      bool io = dynamic_cast<const sqlite::Error*>(&e) != nullptr;
      failures[i] = io ? db_unavailable() : Problem(Code::internal, "internal error");
    }
  }
  return Pass::done;
}

SqliteStore::ReaderLease SqliteStore::reader() {
  std::unique_ptr<Db> db;
  {
    std::lock_guard lock(m_readers_mutex);
    if (!m_readers.empty()) {
      db = std::move(m_readers.back());
      m_readers.pop_back();
    }
  }
  if (!db) db = std::make_unique<Db>(m_path, sqlite::Mode::read_only);
  return ReaderLease(this, std::move(db));
}

SqliteStore::ReaderLease::~ReaderLease() {
  if (!m_db) return;
  std::lock_guard lock(m_store->m_readers_mutex);
  if (m_store->m_readers.size() < 16) m_store->m_readers.push_back(std::move(m_db));
}

// ---- audit ------------------------------------------------------------------------------

const HmacSha256& SqliteStore::audit_mac(Db& db, const std::string& tenant_id) {
  auto it = m_audit_macs.find(tenant_id);
  if (it != m_audit_macs.end()) return it->second;
  std::string salt;
  Use q(db.prepare("SELECT audit_salt FROM tenants WHERE tenant_id = ?1"));
  q->bind(1, tenant_id);
  if (q->step()) salt = q->text(0);
  return m_audit_macs.emplace(tenant_id, HmacSha256(salt)).first->second;
}

void SqliteStore::audit(const std::string& tenant_id, std::string_view type, std::string_view name,
                        std::string_view memory_id, std::optional<std::int64_t> token,
                        std::optional<std::int64_t> renewals) {
  m_pending_audit.push_back(
      PendingAudit{tenant_id, std::string(type), std::string(name), std::string(memory_id), token, renewals});
}

void SqliteStore::write_pending_audit() {
  for (const auto& a : m_pending_audit) {
    const HmacSha256& mac = audit_mac(*m_db, a.tenant_id);
    Use s(m_db->prepare("INSERT INTO audit_events(event_id, tenant_id, event_type, "
                        "redacted_name_hash, redacted_memory_hash, fencing_token, created_at, renewals) "
                        "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"));
    s->bind(1, uuid_v7().to_string())
        .bind(2, a.tenant_id)
        .bind(3, a.type)
        .bind(4, a.name.empty() ? std::string() : mac.hex(a.name))
        .bind(5, a.memory_id.empty() ? std::string() : mac.hex(a.memory_id))
        .bind(6, a.token)
        .bind(7, now_unix_ms())
        .bind(8, a.renewals)
        .run();
  }
  m_pending_audit.clear();
}

// ---- renewals from memory (see the notes at the lease clock) ----------------------------------

namespace {
// When the last renewal from memory was made: its expiry is that renewal's time + TTL
// (a renewal from memory always moves the expiry to now + TTL, the clock being monotonic).
UnixMs renewed_at_of(const RenewalTable::Lease& l) { return l.expires_at - l.ttl_s * 1000; }

// Renewals from memory, written to their row (unless the row was released or granted again):
// the later expiry and the renewals counted.
void write_renewal(Db& db, const std::string& memory_id, const RenewalTable::Lease& l) {
  // (Every expression of SET reads the row as it was.)
  Use s(db.prepare("UPDATE leases SET ttl_seconds = CASE WHEN expires_at < ?2 THEN ?3 ELSE ttl_seconds END, "
                   "expires_at = max(expires_at, ?2), renewals = renewals + ?6, "
                   "renewed_at = CASE WHEN ?6 > 0 THEN ?7 ELSE renewed_at END "
                   "WHERE memory_id = ?1 AND fencing_token = ?4 AND expires_at != ?5 AND (expires_at < ?2 OR ?6 > 0)"));
  s->bind(1, memory_id)
      .bind(2, l.expires_at)
      .bind(3, l.ttl_s)
      .bind(4, l.fencing_token)
      .bind(5, k_released)
      .bind(6, l.renewals)
      .bind(7, renewed_at_of(l))
      .run();
}
} // namespace

void SqliteStore::settle(Db& db, LeaseRow& row) {
  auto kept = m_renewals.take(row.memory_id);
  if (!kept || kept->fencing_token != row.fencing_token || row.expires_at == k_released ||
      (kept->expires_at <= row.expires_at && kept->renewals == 0))
    return;
  write_renewal(db, row.memory_id, *kept);
  if (kept->expires_at > row.expires_at) {
    row.expires_at = kept->expires_at;
    row.ttl_s = kept->ttl_s;
  }
  if (kept->renewals > 0) {
    row.renewals += kept->renewals;
    row.renewed_at = renewed_at_of(*kept);
  }
}

void SqliteStore::overlay(LeaseRow& row) const {
  if (!m_serving || row.expires_at == k_released) return;
  auto l = m_renewals.find(row.memory_id, row.fencing_token);
  if (!l) return;
  if (l->expires_at > row.expires_at) row.expires_at = l->expires_at;
  if (l->renewals > 0) {
    row.renewals += l->renewals;
    row.renewed_at = renewed_at_of(*l);
  }
}

void SqliteStore::flush_renewals(Db& db) {
  for (const auto& p : m_renewals.drain()) write_renewal(db, p.memory_id, p.lease);
}

std::optional<lease::Renewed> SqliteStore::renew_from_memory(const Ctx& ctx, const LeaseRef& ref) {
  if (!m_serving) return std::nullopt;
  const UnixMs now = m_clock.now();
  auto r =
      m_renewals.renew(ref.memory_id, ref.fencing_token,
                       m_renewals.tag(ctx.auth.tenant_id, ref.canonical_name, ref.owner_client_id), ref.ttl_s, now);
  if (!r) return std::nullopt;
  if (r->first_pending) {
    {
      std::lock_guard lock(m_mutex);
      m_flush_wanted = true;
    }
    m_cv.notify_one();
  }
  return lease::Renewed{r->expires_at, ref.ttl_s, now};
}

} // namespace mep::server
