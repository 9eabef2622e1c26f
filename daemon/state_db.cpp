// mepd.db (see state_db.hpp).
#include "mep/state_db.hpp"

#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/sqlite.hpp"
#include "mep/uuid.hpp"

#include <fmt/format.h>

#include <algorithm>

#include <sys/stat.h>
#include <unistd.h>

namespace mep::daemon {
using sqlite::Use;

namespace {

constexpr std::string_view k_schema = R"sql(
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
  path TEXT PRIMARY KEY, memory_id TEXT NOT NULL, dev INTEGER NOT NULL, ino INTEGER NOT NULL,
  sha256 TEXT, updated_at INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS files_inode ON files(dev, ino);
CREATE INDEX IF NOT EXISTS files_sha ON files(sha256);
CREATE INDEX IF NOT EXISTS files_memory ON files(memory_id);
CREATE TABLE IF NOT EXISTS leases (
  canonical_name TEXT PRIMARY KEY, display_name TEXT NOT NULL, memory_id TEXT NOT NULL,
  lease_id TEXT NOT NULL, owner_client_id TEXT NOT NULL, fencing_token INTEGER NOT NULL,
  ttl_seconds INTEGER NOT NULL, expires_at INTEGER NOT NULL, path TEXT NOT NULL, bind_pid INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS registered (memory_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS intents (
  idem_key TEXT PRIMARY KEY, body TEXT NOT NULL, path TEXT NOT NULL, bind_pid INTEGER NOT NULL,
  created_at INTEGER NOT NULL);
)sql";

// A lease's or intent's local user in columns `col` and `col + 1` (NULL: unknown).
void bind_owner(sqlite::Stmt& s, int col, uid_t uid, gid_t gid) {
  if (uid == static_cast<uid_t>(-1))
    s.bind_null(col).bind_null(col + 1);
  else
    s.bind(col, static_cast<std::int64_t>(uid)).bind(col + 1, static_cast<std::int64_t>(gid));
}
void read_owner(sqlite::Stmt& s, int col, uid_t& uid, gid_t& gid) {
  if (s.is_null(col)) return;
  uid = static_cast<uid_t>(s.int64(col));
  gid = static_cast<gid_t>(s.int64(col + 1));
}

} // namespace

StateDb::StateDb(const std::filesystem::path& path) {
  m_db = std::make_unique<sqlite::Db>(path.string(), sqlite::Mode::read_write_create);
  m_db->exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;");
  ::chmod(path.c_str(), 0600);
  m_db->exec(k_schema);
  // Columns newer than the database: its rows have none. The birth time of a file; whose
  // record a path-map row is (one map per local user); the local user that attached a lease
  // or asked for a claim (system mode).
  for (auto [table, column] : {std::pair{"files", "btime"},
                               {"files", "peer_uid"},
                               {"leases", "peer_uid"},
                               {"leases", "peer_gid"},
                               {"intents", "peer_uid"},
                               {"intents", "peer_gid"}})
    if (!sqlite::has_column(*m_db, table, column))
      m_db->exec(fmt::format("ALTER TABLE {} ADD COLUMN {} INTEGER", table, column));
  {
    Use s(m_db->prepare("SELECT value FROM meta WHERE key = 'daemon_id'"));
    if (s->step()) m_daemon_id = s->text(0);
  }
  if (m_daemon_id.empty()) {
    m_daemon_id = uuid_v7().to_string();
    Use s(m_db->prepare("INSERT INTO meta(key, value) VALUES ('daemon_id', ?1)"));
    s->bind(1, m_daemon_id).run();
  }
}

StateDb::~StateDb() = default;

// ---- group commit ---------------------------------------------------------------------------

// Each waiting thread has its own condition variable: a commit wakes the threads whose
// writes it made durable and, when more have queued meanwhile, the one it names to commit
// them next, never every waiting thread (with 64 agents, a broadcast per commit cost more
// CPU than the commits).
struct StateDb::Pending {
  Pending(const std::function<void(sqlite::Db&)>* o, Sync s) : op(o), sync(s) {}
  const std::function<void(sqlite::Db&)>* op;
  Sync sync;
  std::exception_ptr error;
  bool done = false;
  bool lead = false; // named to commit the queue
  std::condition_variable cv;
};

void StateDb::write(const std::function<void(sqlite::Db&)>& op, Sync sync) {
  Pending me(&op, sync);
  std::unique_lock q(m_queue_mutex);
  m_queue.push_back(&me);
  if (m_committing)
    me.cv.wait(q, [&] { return me.done || me.lead; });
  else
    m_committing = true; // no transaction is committing: this thread commits the queue
  if (me.done) {
    if (me.error) std::rethrow_exception(me.error);
    return;
  }
  // This thread commits everything queued, its own write included.
  std::vector<Pending*> batch;
  batch.swap(m_queue);
  q.unlock();
  commit(batch); // never throws: the outcome of each is in its Pending
  q.lock();
  for (Pending* p : batch) {
    p->done = true;
    if (p != &me) p->cv.notify_one(); // under the mutex: the waiter cannot be gone before it
  }
  if (m_queue.empty()) {
    m_committing = false;
  } else {
    m_queue.front()->lead = true; // it commits the writes queued during this commit
    m_queue.front()->cv.notify_one();
  }
  q.unlock();
  if (me.error) std::rethrow_exception(me.error);
}

void StateDb::commit(const std::vector<Pending*>& batch) {
  std::lock_guard lock(m_mutex);
  try {
    // The setting is the connection's, read at COMMIT, and may not change inside a transaction.
    const bool full =
        std::any_of(batch.begin(), batch.end(), [](const Pending* p) { return p->sync == Sync::durable; });
    if (full != m_full) {
      m_db->exec(full ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
      m_full = full;
    }
    m_db->exec("BEGIN IMMEDIATE");
    try {
      for (Pending* p : batch) {
        // A savepoint each: a write that fails (a fault, a constraint) takes only its own
        // changes back.
        m_db->exec("SAVEPOINT w");
        try {
          (*p->op)(*m_db);
          m_db->exec("RELEASE w");
        } catch (...) {
          p->error = std::current_exception();
          m_db->exec("ROLLBACK TO w");
          m_db->exec("RELEASE w");
        }
      }
      m_db->exec("COMMIT");
    } catch (...) {
      try {
        m_db->exec("ROLLBACK");
      } catch (...) {} // SQLite may have rolled back already
      throw;
    }
  } catch (...) {
    const std::exception_ptr e = std::current_exception();
    for (Pending* p : batch)
      if (!p->error) p->error = e;
  }
}

bool StateDb::KnownFile::says(const std::string& id, const FileStat& st, const std::optional<std::string>& sha,
                              uid_t owner) const {
  return memory_id == id && dev == st.dev && ino == st.ino && btime == st.birth_ns &&
         uid == static_cast<std::int64_t>(owner) && (!sha || sha256 == sha);
}

void StateDb::remember_file(const std::string& memory_id, const std::string& path, const FileStat& st,
                            const std::optional<std::string>& sha256, uid_t uid) {
  {
    // Most binds find the row as it would be written (an agent attaching and detaching the
    // same file): then there is nothing to make durable, and no transaction to wait for.
    // The path's row is read once and kept in memory, so the next check needs no read
    // either. The read and the keeping are one step under m_cache_mutex, and a write forgets
    // what was kept after it commits: what is kept is never older than the row.
    std::lock_guard cache(m_cache_mutex);
    auto known = m_known_files.find(path);
    if (known == m_known_files.end()) {
      std::lock_guard lock(m_mutex);
      Use s(m_db->prepare("SELECT memory_id, dev, ino, btime, peer_uid, sha256 FROM files WHERE path = ?1"));
      s->bind(1, path);
      if (s->step()) {
        if (m_known_files.size() >= k_known_files) m_known_files.clear();
        known = m_known_files
                    .emplace(path, KnownFile{s->text(0), static_cast<std::uint64_t>(s->int64(1)),
                                             static_cast<std::uint64_t>(s->int64(2)), s->opt_int64(3), s->opt_int64(4),
                                             s->opt_text(5)})
                    .first;
      }
    }
    if (known != m_known_files.end() && known->second.says(memory_id, st, sha256, uid)) return;
  }
  const std::int64_t now = now_unix_ms();
  write([&](sqlite::Db& db) {
    // A new fingerprint replaces the old; without one, the old is kept only while the path
    // still names the same memory.
    Use s(db.prepare("INSERT INTO files(path, memory_id, dev, ino, sha256, updated_at, btime, peer_uid) "
                     "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) "
                     "ON CONFLICT(path) DO UPDATE SET memory_id = ?2, dev = ?3, ino = ?4, "
                     "sha256 = coalesce(?5, CASE WHEN files.memory_id = ?2 THEN files.sha256 END), updated_at = ?6, "
                     "btime = ?7, peer_uid = ?8"));
    s->bind(1, path)
        .bind(2, memory_id)
        .bind(3, static_cast<std::int64_t>(st.dev))
        .bind(4, static_cast<std::int64_t>(st.ino))
        .bind(5, sha256)
        .bind(6, now)
        .bind(7, st.birth_ns)
        .bind(8, static_cast<std::int64_t>(uid))
        .run();
  });
  std::lock_guard cache(m_cache_mutex);
  m_known_files.erase(path);
}

// Rows without a user were made before there were several: the daemon's own user's.
std::string row_uid() { return "coalesce(peer_uid, " + std::to_string(::getuid()) + ")"; }

std::optional<std::string> StateDb::memory_by_inode(const FileStat& st, uid_t uid) {
  std::lock_guard lock(m_mutex);
  Use s(m_db->prepare(std::string("SELECT memory_id FROM files WHERE dev = ?1 AND ino = ?2 "
                                  "AND (btime IS NULL OR ?3 IS NULL OR btime = ?3) AND ") +
                      row_uid() + " = ?4 LIMIT 1"));
  s->bind(1, static_cast<std::int64_t>(st.dev))
      .bind(2, static_cast<std::int64_t>(st.ino))
      .bind(3, st.birth_ns)
      .bind(4, static_cast<std::int64_t>(uid));
  if (s->step()) return s->text(0);
  return std::nullopt;
}

bool StateDb::memory_of_other_user(const std::string& memory_id, uid_t uid) {
  std::lock_guard lock(m_mutex);
  Use s(m_db->prepare(std::string("SELECT count(*) FILTER (WHERE ") + row_uid() + " = ?2), count(*) FROM files " +
                      "WHERE memory_id = ?1"));
  s->bind(1, memory_id).bind(2, static_cast<std::int64_t>(uid));
  return s->step() && s->int64(0) == 0 && s->int64(1) > 0;
}

std::vector<std::string> StateDb::memories_by_content(const std::string& sha256, uid_t uid) {
  std::lock_guard lock(m_mutex);
  Use s(m_db->prepare(std::string("SELECT DISTINCT memory_id FROM files WHERE sha256 = ?1 AND ") + row_uid() +
                      " = ?2 LIMIT 2"));
  s->bind(1, sha256).bind(2, static_cast<std::int64_t>(uid));
  std::vector<std::string> found;
  while (s->step()) found.push_back(s->text(0));
  return found;
}

bool StateDb::registered(const std::string& memory_id) {
  {
    std::lock_guard cache(m_cache_mutex);
    if (m_registered.count(memory_id)) return true;
  }
  {
    std::lock_guard lock(m_mutex);
    Use s(m_db->prepare("SELECT 1 FROM registered WHERE memory_id = ?1"));
    s->bind(1, memory_id);
    if (!s->step()) return false;
  }
  known_registered(memory_id);
  return true;
}

void StateDb::mark_registered(const std::string& memory_id) {
  write([&](sqlite::Db& db) {
    Use s(db.prepare("INSERT OR IGNORE INTO registered(memory_id) VALUES (?1)"));
    s->bind(1, memory_id).run();
  });
  known_registered(memory_id);
}

void StateDb::known_registered(const std::string& memory_id) {
  std::lock_guard cache(m_cache_mutex);
  if (m_registered.size() >= k_known_files) m_registered.clear();
  m_registered.insert(memory_id);
}

void StateDb::save_lease(const SavedLease& l, const std::string& finished_intent) {
  write(
      [&](sqlite::Db& db) {
        Use s(db.prepare("INSERT OR REPLACE INTO leases(canonical_name, display_name, memory_id, lease_id, "
                         "owner_client_id, fencing_token, ttl_seconds, expires_at, path, bind_pid, peer_uid, "
                         "peer_gid) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)"));
        s->bind(1, l.canonical_name)
            .bind(2, l.display_name)
            .bind(3, l.memory_id)
            .bind(4, l.lease_id)
            .bind(5, l.owner_client_id)
            .bind(6, l.fencing_token)
            .bind(7, l.ttl_s)
            .bind(8, l.expires_at)
            .bind(9, l.path)
            .bind(10, static_cast<std::int64_t>(l.bind_pid));
        bind_owner(*s, 11, l.uid, l.gid);
        s->run();
        if (!finished_intent.empty()) {
          Use d(db.prepare("DELETE FROM intents WHERE idem_key = ?1"));
          d->bind(1, finished_intent).run();
        }
      },
      Sync::lazy);
}

void StateDb::save_expiries(const std::vector<std::pair<std::string, UnixMs>>& expiries) {
  if (expiries.empty()) return;
  write([&](sqlite::Db& db) {
    for (const auto& [name, expires] : expiries) {
      Use u(db.prepare("UPDATE leases SET expires_at = ?1 WHERE canonical_name = ?2"));
      u->bind(1, expires).bind(2, name).run();
    }
  });
}

void StateDb::forget_lease(const std::string& canonical_name, const std::string& lease_id, Sync sync) {
  write(
      [&](sqlite::Db& db) {
        Use s(db.prepare("DELETE FROM leases WHERE canonical_name = ?1 AND (?2 IS NULL OR lease_id = ?2)"));
        s->bind(1, canonical_name)
            .bind(2, lease_id.empty() ? std::nullopt : std::optional<std::string>(lease_id))
            .run();
      },
      sync);
}

std::vector<SavedLease> StateDb::leases() {
  std::lock_guard lock(m_mutex);
  Use s(m_db->prepare("SELECT canonical_name, display_name, memory_id, lease_id, owner_client_id, "
                      "fencing_token, ttl_seconds, expires_at, path, bind_pid, peer_uid, peer_gid FROM leases"));
  std::vector<SavedLease> out;
  while (s->step()) {
    out.push_back(SavedLease{s->text(0), s->text(1), s->text(2), s->text(3), s->text(4), s->int64(5), s->int64(6),
                             s->int64(7), s->text(8), static_cast<pid_t>(s->int64(9))});
    read_owner(*s, 10, out.back().uid, out.back().gid);
  }
  return out;
}

void StateDb::add_intent(const Intent& in) {
  const std::string body = json::dump(lease::wire::to_json(in.request));
  const std::int64_t now = now_unix_ms();
  write([&](sqlite::Db& db) {
    Use s(db.prepare("INSERT INTO intents(idem_key, body, path, bind_pid, created_at, peer_uid, peer_gid) "
                     "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"));
    s->bind(1, in.key).bind(2, body).bind(3, in.path).bind(4, static_cast<std::int64_t>(in.bind_pid)).bind(5, now);
    bind_owner(*s, 6, in.uid, in.gid);
    s->run();
  });
}

void StateDb::orphan_intent(const std::string& key) {
  write([&](sqlite::Db& db) {
    Use s(db.prepare("UPDATE intents SET bind_pid = -1 WHERE idem_key = ?1"));
    s->bind(1, key).run();
  });
}

void StateDb::delete_intent(const std::string& key) {
  write([&](sqlite::Db& db) {
    Use s(db.prepare("DELETE FROM intents WHERE idem_key = ?1"));
    s->bind(1, key).run();
  });
}

bool StateDb::has_intent(const std::string& key) {
  std::lock_guard lock(m_mutex);
  Use s(m_db->prepare("SELECT 1 FROM intents WHERE idem_key = ?1"));
  s->bind(1, key);
  return s->step();
}

std::vector<Intent> StateDb::intents() {
  std::lock_guard lock(m_mutex);
  Use s(m_db->prepare("SELECT idem_key, body, path, bind_pid, peer_uid, peer_gid FROM intents"));
  std::vector<Intent> out;
  while (s->step()) {
    auto body = json::parse_object(s->text(1));
    if (!body) continue;
    auto req = lease::wire::decode_claim_request(*body);
    if (!req) continue;
    out.push_back(Intent{s->text(0), std::move(*req), s->text(2), static_cast<pid_t>(s->int64(3))});
    read_owner(*s, 4, out.back().uid, out.back().gid);
  }
  return out;
}

} // namespace mep::daemon
