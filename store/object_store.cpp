// mep store's storage (see object_store.hpp for the design notes).
#include "mep/object_store.hpp"

#include "mep/log.hpp"
#include "mep/sqlite.hpp"
#include "mep/uuid.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::store {
namespace fs = std::filesystem;
using sqlite::Use;

namespace {

constexpr std::size_t k_max_group = 512;
constexpr std::uint64_t k_writeback_step = 256 * 1024;
constexpr int k_syncers = 4;
// The pool of empty version files: refilled to k_pool_size when it falls below k_pool_low.
constexpr std::size_t k_pool_size = 64;
constexpr std::size_t k_pool_low = 32;

constexpr std::string_view k_schema = R"sql(
CREATE TABLE IF NOT EXISTS marks (
  memory_id  TEXT PRIMARY KEY,
  mark       INTEGER NOT NULL,
  token      INTEGER,
  etag       TEXT,
  size       INTEGER,
  modified   INTEGER
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
)sql";

// The bytes of a small object, in its row (NULL: in its version file).
constexpr std::string_view k_inline_column = "ALTER TABLE marks ADD COLUMN data BLOB";

Problem sqlite_problem(const sqlite::Error& e) {
  if ((e.code() & 0xff) == SQLITE_FULL) return Problem(Code::insufficient_storage, "the data plane's disk is full");
  Problem p(Code::unavailable, "the data plane's database is unavailable");
  p.retry_after_s = 1;
  return p;
}

FenceState read_state(sqlite::Db& db, const std::string& memory_id) {
  Use s(db.prepare("SELECT mark, token, etag, size, modified FROM marks WHERE memory_id = ?1"));
  s->bind(1, memory_id);
  FenceState st;
  if (!s->step()) return st;
  st.mark = s->int64(0);
  if (!s->is_null(2)) {
    ObjectInfo o;
    o.memory_id = memory_id;
    o.fencing_token = s->int64(1);
    o.etag = s->text(2);
    o.size = static_cast<std::uint64_t>(s->int64(3));
    o.modified = s->int64(4);
    st.object = std::move(o);
  }
  return st;
}

int fsync_retrying(int fd) {
  while (::fsync(fd) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

} // namespace

Problem stale_fence(std::int64_t presented, std::int64_t current) {
  Problem p(Code::stale_fence, fmt::format("fencing token {} is lower than {}, the highest this store has seen "
                                           "for this memory: a newer holder has it",
                                           presented, current));
  p.extensions["presented_token"] = presented;
  p.extensions["current_token"] = current;
  return p;
}

Problem disk_problem(int err, const std::string& what) {
  if (err == ENOSPC || err == EDQUOT)
    return Problem(Code::insufficient_storage, "the data plane's disk is full (" + what + ")");
  Problem p(Code::unavailable, "the data plane cannot " + what + ": " + std::strerror(err));
  p.retry_after_s = 1;
  return p;
}

// ---- uploads ----------------------------------------------------------------------------------

Upload::Upload(ObjectStore& store, std::string memory_id, std::string etag, std::uint64_t limit)
    : m_store(store), m_memory_id(std::move(memory_id)), m_etag(std::move(etag)), m_limit(limit) {}

Upload::~Upload() {
  if (m_fd >= 0) ::close(m_fd);
  if (m_spilled && !m_committed) {
    std::error_code ec;
    fs::remove(m_path, ec);
  }
}

// The bytes so far move to the version file, and the rest goes there as it comes: a file
// from the pool (its name durable already, so the version is named by its etag), else a new
// one whose name the commit makes durable.
std::optional<Problem> Upload::spill() {
  if (auto pooled = m_store.take_pooled()) {
    fs::path path = m_store.version_path(*pooled);
    m_fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (m_fd >= 0) {
      m_etag = std::move(*pooled);
      m_path = std::move(path);
    }
  }
  if (m_fd < 0) {
    m_path = m_store.version_path(m_etag);
    m_fd = ::open(m_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (m_fd < 0) return disk_problem(errno, "create the object");
    m_new_name = true;
  }
  m_spilled = true;
  std::string head = std::move(m_inline);
  m_inline.clear();
  m_inline.shrink_to_fit();
  for (std::size_t done = 0; done < head.size();) {
    ssize_t w = ::write(m_fd, head.data() + done, head.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return disk_problem(errno, "write the object");
    done += static_cast<std::size_t>(w);
  }
  return std::nullopt;
}

std::optional<Problem> Upload::write(const void* data, std::size_t size) {
  if (m_size + size > m_limit) return Problem(Code::payload_too_large, "the object exceeds the store's limit");
  if (!m_spilled && m_inline.size() + size <= k_inline_max) {
    m_inline.append(static_cast<const char*>(data), size);
    m_size += size;
    return std::nullopt;
  }
  if (!m_spilled) {
    if (auto p = spill()) return p;
  }
  const char* p = static_cast<const char*>(data);
  std::size_t done = 0;
  while (done < size) {
    ssize_t w = ::write(m_fd, p + done, size - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return disk_problem(errno, "write the object");
    done += static_cast<std::size_t>(w);
  }
  m_size += size;
  // Start writing back what has arrived while the rest is still on its way, so the fsync
  // at the end has less to wait for (and dirty pages do not pile up for large objects).
  if (m_size - m_flushed >= k_writeback_step) {
    ::sync_file_range(m_fd, static_cast<off64_t>(m_flushed), static_cast<off64_t>(m_size - m_flushed),
                      SYNC_FILE_RANGE_WRITE);
    m_flushed = m_size;
  }
  return std::nullopt;
}

// ---- construction ---------------------------------------------------------------------------

ObjectStore::ObjectStore(fs::path dir, std::uint64_t max_object_size)
    : m_dir(std::move(dir)), m_objects(m_dir / "objects"), m_max_object_size(max_object_size) {
  std::error_code ec;
  fs::create_directories(m_objects, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create {}: {}", m_objects.string(), ec.message()));
  ::chmod(m_dir.c_str(), 0700);
  ::chmod(m_objects.c_str(), 0700);
  const fs::path lock = m_dir / "store.lock";
  m_lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (m_lock_fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", lock.string(), std::strerror(errno)));
  if (::flock(m_lock_fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(m_lock_fd);
    throw std::runtime_error(fmt::format("another mep store is running with the directory {}", m_dir.string()));
  }
  m_objects_fd = ::open(m_objects.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (m_objects_fd < 0)
    throw std::runtime_error(fmt::format("cannot open {}: {}", m_objects.string(), std::strerror(errno)));
  const std::string db_path = (m_dir / "store.db").string();
  m_db = std::make_unique<sqlite::Db>(db_path, sqlite::Mode::read_write_create);
  m_db->exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;");
  ::chmod(db_path.c_str(), 0600);
  m_db->exec(k_schema);
  {
    Use q(m_db->prepare("SELECT count(*) FROM pragma_table_info('marks') WHERE name = 'data'"));
    if (q->step() && q->int64(0) == 0) m_db->exec(k_inline_column);
  }
  recover();
  m_pool_wanted = true; // the syncers make the pool before the first large upload needs it
  m_writer = std::thread([this] { writer_loop(); });
  for (int i = 0; i < k_syncers; ++i) m_syncers.emplace_back([this] { sync_loop(); });
}

ObjectStore::~ObjectStore() {
  // The syncers finish what they hold and stop; then the writer finishes what they gave it.
  {
    std::lock_guard lock(m_mutex);
    m_stop = true;
  }
  m_sync_cv.notify_all();
  for (auto& t : m_syncers) t.join();
  {
    std::lock_guard lock(m_mutex);
    m_writer_stop = true;
  }
  m_cv.notify_all();
  if (m_writer.joinable()) m_writer.join();
  std::error_code ec;
  for (const auto& e : m_pool) fs::remove(version_path(e), ec); // else the next start does it
  m_db.reset();
  if (m_objects_fd >= 0) ::close(m_objects_fd);
  if (m_lock_fd >= 0) ::close(m_lock_fd);
}

// Removes every version file the database does not name: uploads a crash interrupted,
// versions whose removal a crash prevented, and the pool of the previous run.
void ObjectStore::recover() {
  std::set<std::string> current; // the etags rows name (an etag is never reused)
  {
    Use s(m_db->prepare("SELECT etag FROM marks WHERE etag IS NOT NULL"));
    while (s->step()) current.insert(s->text(0));
  }
  std::size_t removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(m_objects, ec)) {
    const std::string name = entry.path().filename().string();
    const auto dot = name.rfind('.'); // <etag>, or <memory id>.<etag> from before the pool
    const bool keep = current.count(dot == std::string::npos ? name : name.substr(dot + 1)) != 0;
    if (!keep && fs::remove(entry.path(), ec)) ++removed;
  }
  if (ec) throw std::runtime_error(fmt::format("cannot read {}: {}", m_objects.string(), ec.message()));
  if (removed)
    log::info("removed {} object files no write committed (interrupted uploads, replaced versions, the pool)", removed);
}

fs::path ObjectStore::version_path(const std::string& etag) const { return m_objects / etag; }

fs::path ObjectStore::legacy_version_path(const std::string& memory_id, const std::string& etag) const {
  return m_objects / (memory_id + "." + etag);
}

std::optional<std::string> ObjectStore::take_pooled() {
  std::optional<std::string> out;
  bool wake = false;
  {
    std::lock_guard lock(m_mutex);
    if (!m_pool.empty()) {
      out = std::move(m_pool.front());
      m_pool.pop_front();
    }
    if (m_pool.size() < k_pool_low && !m_pool_refilling && !m_pool_wanted) wake = m_pool_wanted = true;
  }
  if (wake) m_sync_cv.notify_one();
  return out;
}

std::size_t ObjectStore::pooled() {
  std::lock_guard lock(m_mutex);
  return m_pool.size();
}

void ObjectStore::refill_pool() {
  std::size_t want;
  {
    std::lock_guard lock(m_mutex);
    want = m_pool.size() < k_pool_size ? k_pool_size - m_pool.size() : 0;
  }
  std::vector<std::string> made;
  for (std::size_t i = 0; i < want; ++i) {
    std::string etag = uuid_v7().to_string();
    int fd = ::open(version_path(etag).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) break; // a full disk (no inode): uploads make their own files meanwhile
    ::close(fd);
    made.push_back(std::move(etag));
  }
  // Only names a directory fsync has made durable go in the pool.
  if (!made.empty() && fsync_retrying(m_objects_fd) != 0) {
    std::error_code ec;
    for (const auto& e : made) fs::remove(version_path(e), ec);
    made.clear();
  }
  std::lock_guard lock(m_mutex);
  for (auto& e : made) m_pool.push_back(std::move(e));
  m_pool_refilling = false;
}

// ---- writes ----------------------------------------------------------------------------------

expected<std::unique_ptr<Upload>, Problem> ObjectStore::begin(const std::string& memory_id) {
  return std::unique_ptr<Upload>(new Upload(*this, memory_id, uuid_v7().to_string(), m_max_object_size));
}

void ObjectStore::commit(std::unique_ptr<Upload> upload, std::int64_t token, Precondition pre, CommitDone done) {
  CommitJob job{std::move(upload), token, std::move(pre), std::move(done)};
  if (!job.upload->in_file()) return enqueue(std::move(job)); // its bytes go in the commit itself
  {
    std::lock_guard lock(m_mutex);
    m_sync_queue.push_back(std::move(job));
  }
  m_sync_cv.notify_one();
}

// Makes uploads durable before they reach the writer: their fsyncs run side by side here,
// not one after another on the writer.
void ObjectStore::sync_loop() {
  for (;;) {
    std::optional<CommitJob> job;
    std::vector<fs::path> garbage;
    {
      std::unique_lock lock(m_mutex);
      m_sync_cv.wait(lock, [&] { return m_stop || !m_sync_queue.empty() || !m_garbage.empty() || m_pool_wanted; });
      if (!m_sync_queue.empty()) {
        job = std::move(m_sync_queue.front());
        m_sync_queue.pop_front();
      } else if (m_pool_wanted && !m_stop) {
        m_pool_wanted = false;
        m_pool_refilling = true;
        lock.unlock();
        try {
          refill_pool();
        } catch (const std::exception& e) {
          log::error("object pool refill failed: {}", e.what());
          std::lock_guard relock(m_mutex);
          m_pool_refilling = false;
        }
        continue;
      } else if (!m_garbage.empty()) {
        garbage.assign(std::make_move_iterator(m_garbage.begin()), std::make_move_iterator(m_garbage.end()));
        m_garbage.clear();
      } else {
        return; // stopping
      }
    }
    std::error_code ec;
    for (const auto& g : garbage) fs::remove(g, ec); // unlinking a large file takes milliseconds
    if (!job) continue;
    try {
      if (int err = fsync_retrying(job->upload->m_fd); err != 0) {
        job->done(make_unexpected(disk_problem(err, "make the object durable")));
        continue;
      }
      ::close(job->upload->m_fd);
      job->upload->m_fd = -1;
      enqueue(std::move(*job));
    } catch (const std::exception& e) {
      log::error("object sync failed: {}", e.what());
    }
  }
}

void ObjectStore::advance(std::string memory_id, std::int64_t token, AdvanceDone done) {
  enqueue(AdvanceJob{std::move(memory_id), token, std::move(done)});
}

void ObjectStore::enqueue(Job job) {
  {
    std::lock_guard lock(m_mutex);
    m_queue.push_back(std::move(job));
  }
  m_cv.notify_one();
}

void ObjectStore::writer_loop() {
  std::vector<Job> batch;
  for (;;) {
    {
      std::unique_lock lock(m_mutex);
      m_cv.wait(lock, [&] { return m_writer_stop || !m_queue.empty(); });
      if (m_queue.empty()) return; // stopping, and the syncers (stopped first) gave all they had
      const std::size_t n = std::min(m_queue.size(), k_max_group);
      for (std::size_t i = 0; i < n; ++i) {
        batch.push_back(std::move(m_queue.front()));
        m_queue.pop_front();
      }
    }
    try {
      run_batch(batch);
    } catch (const std::exception& e) {
      log::error("store writer: {}", e.what()); // run_batch answered every job already
    }
    batch.clear();
  }
}

// One group of commits and advances: the directory fsync (the new version files' names) and
// one transaction for all of them, then the answers, then the files no one needs any more.
void ObjectStore::run_batch(std::vector<Job>& batch) {
  struct Outcome {
    std::variant<expected<ObjectInfo, Problem>, expected<std::int64_t, Problem>> value;
  };
  std::vector<Outcome> out;
  out.reserve(batch.size());
  std::vector<fs::path> garbage; // replaced versions and refused uploads, removed at the end
  auto fail_all = [&](const Problem& p) {
    for (auto& job : batch) {
      if (auto* c = std::get_if<CommitJob>(&job))
        c->done(make_unexpected(p));
      else
        std::get<AdvanceJob>(job).done(make_unexpected(p));
    }
  };
  const bool new_names = std::any_of(batch.begin(), batch.end(), [](const Job& j) {
    auto* c = std::get_if<CommitJob>(&j);
    return c && c->upload->in_file() && c->upload->m_new_name;
  });
  if (new_names) {
    if (int err = fsync_retrying(m_objects_fd); err != 0) {
      m_healthy = false;
      return fail_all(disk_problem(err, "make the object durable"));
    }
  }
  try {
    Use(m_db->prepare("BEGIN IMMEDIATE"))->run();
    const UnixMs now = now_unix_ms();
    for (auto& job : batch) {
      if (auto* c = std::get_if<CommitJob>(&job)) {
        FenceState st = read_state(*m_db, c->upload->memory_id());
        if (c->token < st.mark) {
          out.push_back({expected<ObjectInfo, Problem>(make_unexpected(stale_fence(c->token, st.mark)))});
          continue;
        }
        const auto& wanted = c->pre.if_match;
        if (wanted && (!st.object || (!wanted->empty() &&
                                      std::find(wanted->begin(), wanted->end(), st.object->etag) == wanted->end()))) {
          out.push_back({expected<ObjectInfo, Problem>(make_unexpected(
              Problem(Code::precondition_failed, st.object ? "If-Match: the current object is another version"
                                                           : "If-Match: there is no object yet")))});
          continue;
        }
        if (c->pre.if_none_match_any && st.object) {
          out.push_back({expected<ObjectInfo, Problem>(
              make_unexpected(Problem(Code::precondition_failed, "If-None-Match: *: an object exists already")))});
          continue;
        }
        ObjectInfo info{c->upload->memory_id(), c->token, c->upload->m_etag, c->upload->size(), now};
        Use s(m_db->prepare("INSERT INTO marks(memory_id, mark, token, etag, size, modified, data) "
                            "VALUES (?1, ?2, ?2, ?3, ?4, ?5, ?6) ON CONFLICT(memory_id) DO UPDATE SET mark = ?2, "
                            "token = ?2, etag = ?3, size = ?4, modified = ?5, data = ?6"));
        s->bind(1, info.memory_id)
            .bind(2, c->token)
            .bind(3, info.etag)
            .bind(4, static_cast<std::int64_t>(info.size))
            .bind(5, now);
        if (c->upload->in_file())
          s->bind_null(6);
        else
          s->bind_blob(6, c->upload->m_inline.data(), c->upload->m_inline.size());
        s->run();
        // The version replaced, if it had a file (one that had none leaves nothing behind).
        if (st.object) {
          garbage.push_back(version_path(st.object->etag));
          garbage.push_back(legacy_version_path(info.memory_id, st.object->etag));
        }
        out.push_back({expected<ObjectInfo, Problem>(std::move(info))});
      } else {
        auto& a = std::get<AdvanceJob>(job);
        FenceState st = read_state(*m_db, a.memory_id);
        if (a.token < st.mark) {
          out.push_back({expected<std::int64_t, Problem>(make_unexpected(stale_fence(a.token, st.mark)))});
          continue;
        }
        if (a.token > st.mark) {
          Use s(m_db->prepare("INSERT INTO marks(memory_id, mark) VALUES (?1, ?2) "
                              "ON CONFLICT(memory_id) DO UPDATE SET mark = ?2"));
          s->bind(1, a.memory_id).bind(2, a.token).run();
        }
        out.push_back({expected<std::int64_t, Problem>(a.token)});
      }
    }
    Use(m_db->prepare("COMMIT"))->run();
    m_healthy = true;
  } catch (const sqlite::Error& e) {
    log::error("store transaction failed: {}", e.what());
    try {
      if (!::sqlite3_get_autocommit(m_db->handle())) m_db->exec("ROLLBACK");
    } catch (...) {}
    m_healthy = false;
    return fail_all(sqlite_problem(e)); // the uploads' files go with their Upload
  }
  // Durable: answer, then let go of what is no longer current.
  for (std::size_t i = 0; i < batch.size(); ++i) {
    if (auto* c = std::get_if<CommitJob>(&batch[i])) {
      auto& r = std::get<0>(out[i].value);
      if (r) c->upload->m_committed = true;
      c->done(std::move(r));
      c->upload.reset(); // an uncommitted upload removes its file
    } else {
      std::get<AdvanceJob>(batch[i]).done(std::move(std::get<1>(out[i].value)));
    }
  }
  if (!garbage.empty()) {
    {
      std::lock_guard lock(m_mutex);
      for (auto& g : garbage) m_garbage.push_back(std::move(g));
    }
    m_sync_cv.notify_one();
  }
}

// ---- reads -----------------------------------------------------------------------------------

std::unique_ptr<sqlite::Db> ObjectStore::reader() {
  {
    std::lock_guard lock(m_readers_mutex);
    if (!m_readers.empty()) {
      auto db = std::move(m_readers.back());
      m_readers.pop_back();
      return db;
    }
  }
  return std::make_unique<sqlite::Db>((m_dir / "store.db").string(), sqlite::Mode::read_only);
}

void ObjectStore::give_back(std::unique_ptr<sqlite::Db> db) {
  std::lock_guard lock(m_readers_mutex);
  if (m_readers.size() < 16) m_readers.push_back(std::move(db));
}

expected<FenceState, Problem> ObjectStore::state(const std::string& memory_id) {
  try {
    auto db = reader();
    FenceState st = read_state(*db, memory_id);
    give_back(std::move(db));
    return st;
  } catch (const sqlite::Error& e) {
    log::error("store read failed: {}", e.what());
    return make_unexpected(sqlite_problem(e));
  }
}

expected<OpenObject, Problem> ObjectStore::open(const std::string& memory_id) {
  // A commit may replace the version between the lookup and the open: look again.
  for (int attempt = 0; attempt < 8; ++attempt) {
    auto st = state(memory_id);
    if (!st) return make_unexpected(std::move(st.error()));
    if (!st->object)
      return make_unexpected(Problem(Code::memory_not_found, "the store holds no object for this memory"));
    if (auto data = inline_data(memory_id, st->object->etag))
      return OpenObject{std::move(*st->object), -1, std::move(*data)};
    int fd = -1;
    for (const auto& path : {version_path(st->object->etag), legacy_version_path(memory_id, st->object->etag)}) {
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0 || errno != ENOENT) break;
    }
    if (fd >= 0) return OpenObject{std::move(*st->object), fd, std::nullopt};
    if (errno != ENOENT) return make_unexpected(disk_problem(errno, "read the object"));
  }
  Problem p(Code::unavailable, "the object changed too often while it was being opened");
  p.retry_after_s = 1;
  return make_unexpected(std::move(p));
}

std::optional<std::string> ObjectStore::inline_data(const std::string& memory_id, const std::string& etag) {
  try {
    auto db = reader();
    std::optional<std::string> out;
    {
      Use s(db->prepare("SELECT data FROM marks WHERE memory_id = ?1 AND etag = ?2 AND data IS NOT NULL"));
      s->bind(1, memory_id).bind(2, etag);
      if (s->step()) out = s->blob(0);
    }
    give_back(std::move(db));
    return out;
  } catch (const sqlite::Error& e) {
    log::error("store read failed: {}", e.what());
    return std::nullopt;
  }
}

bool ObjectStore::ready() {
  if (!m_healthy) return false;
  try {
    auto db = reader();
    bool ok = false;
    {
      Use s(db->prepare("SELECT 1"));
      ok = s->step();
    }
    give_back(std::move(db));
    return ok;
  } catch (...) {
    return false;
  }
}

} // namespace mep::store
