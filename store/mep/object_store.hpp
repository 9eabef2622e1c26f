// mep store's storage: per memory, the highest fencing token seen (the mark) and the
// current object, on disk in one directory (SPEC §8). HTTP-free: the store server and the
// unit tests drive it.
#pragma once
#include "mep/expected.hpp"
#include "mep/problem.hpp"
#include "mep/time.hpp"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

namespace mep::sqlite {
class Db;
}

namespace mep::store {

/// The object a memory's current bytes are.
struct ObjectInfo {
  std::string memory_id;
  std::int64_t fencing_token = 0; ///< the token the bytes were written with
  std::string etag;               ///< the version (unquoted); a new one per accepted write
  std::uint64_t size = 0;
  UnixMs modified = 0;
};

/// What the store knows of one memory.
struct FenceState {
  std::int64_t mark = 0; ///< the highest token seen (by a write or an advance); 0: none
  std::optional<ObjectInfo> object;
};

/// Conditions a write puts on the current object, besides the fence.
struct Precondition {
  /// If-Match: the current object's etag must be one of these; an empty list (`*`) asks
  /// only that an object exists.
  std::optional<std::vector<std::string>> if_match;
  bool if_none_match_any = false; ///< If-None-Match: * — there must be no object yet
};

class ObjectStore;

/// Objects up to this size are kept in the database row itself: their bytes are made
/// durable by the same WAL commit as the mark (one fsync for a whole group of writes).
inline constexpr std::size_t k_inline_max = 64 * 1024;

/// The bytes of one write on their way to disk, made current by ObjectStore::commit only:
/// in memory while they are at most k_inline_max, else a new version file. One that is
/// dropped uncommitted removes its file.
class Upload {
public:
  ~Upload();
  Upload(const Upload&) = delete;
  Upload& operator=(const Upload&) = delete;

  /// Appends bytes; a problem (507 on a full disk, 503 on an I/O error, 413 past the
  /// limit) ends the upload.
  std::optional<Problem> write(const void* data, std::size_t size);
  std::uint64_t size() const { return m_size; }
  const std::string& memory_id() const { return m_memory_id; }
  bool in_file() const { return m_fd >= 0 || m_spilled; }

private:
  friend class ObjectStore;
  Upload(ObjectStore& store, std::string memory_id, std::string etag, std::uint64_t limit);
  std::optional<Problem> spill();
  ObjectStore& m_store;
  std::filesystem::path m_path;
  int m_fd = -1;
  bool m_spilled = false;
  /// The file's name is new since the objects directory was last fsynced: the commit fsyncs
  /// the directory first. False for a file from the pool, whose name is durable already.
  bool m_new_name = false;
  std::string m_inline;
  std::string m_memory_id;
  std::string m_etag;
  std::uint64_t m_limit;
  std::uint64_t m_size = 0;
  std::uint64_t m_flushed = 0; ///< bytes handed to writeback so far
  bool m_committed = false;
};

/// An object opened for reading: its bytes in `inline_data`, or in the file `fd` (the
/// caller owns it).
struct OpenObject {
  ObjectInfo info;
  int fd = -1;
  std::optional<std::string> inline_data;
};

/// Design notes.
/// * Layout: DIR/store.db (SQLite, WAL, synchronous=FULL) holds one row per memory: the
///   mark and the current object's token, etag, size and time, and the bytes of a small
///   object (≤ k_inline_max). DIR/objects/<etag> is a larger object's bytes
///   (DIR/objects/<id>.<etag> in directories written before the pool); a file the database
///   does not name is garbage (an upload that never committed, a version replaced, a pool
///   file left by a restart), removed at start and, after each commit, by the syncer threads.
/// * The pool: empty files made ahead of need by a syncer thread, whose names a directory
///   fsync has made durable before any upload takes one. A large upload writes into one, so
///   its commit needs the file's fsync but no directory fsync (one flush fewer on the path
///   of every large PUT). With the pool empty, an upload creates its file and the commit
///   fsyncs the directory, as before.
/// * A write (begin → Upload::write … → commit): a small object's bytes stay in memory; a
///   larger one's go to a version file, which commit fsyncs (on a syncer thread). The
///   writer thread then, for a whole group of commits and advances at once, fsyncs the
///   objects directory (when a group has a file whose name is new) and runs one transaction
///   that applies the fence rule to each in turn and COMMITs. A reply is given only after
///   that COMMIT: an acknowledged write survives a crash; a crash at any earlier instant
///   leaves the previous object current (its bytes are untouched).
/// * The rule (apply_commit, apply_advance), one writer so no interleaving: a token lower
///   than the mark is refused (409 stale-fence, naming both tokens) and changes nothing;
///   equal or higher is accepted and the mark becomes it.
/// * Reads use their own connections and never wait for the writer; a version file that a
///   commit removes while a read opens it is looked up again.
/// * One process per directory (flock on DIR/store.lock).
class ObjectStore {
  friend class Upload; // its spill takes a file from the pool
public:
  /// Opens (creating) `dir`. Throws std::runtime_error with a readable message.
  ObjectStore(std::filesystem::path dir, std::uint64_t max_object_size);
  ~ObjectStore();
  ObjectStore(const ObjectStore&) = delete;
  ObjectStore& operator=(const ObjectStore&) = delete;

  /// A new upload for `memory_id`, or a problem (507/503) when its file cannot be made.
  expected<std::unique_ptr<Upload>, Problem> begin(const std::string& memory_id);

  using CommitDone = std::function<void(expected<ObjectInfo, Problem>)>;
  /// Makes the upload durable and, in one step with the fence check and `pre`, current.
  /// `done` runs once, on a store thread, after the outcome is durable.
  void commit(std::unique_ptr<Upload> upload, std::int64_t token, Precondition pre, CommitDone done);

  using AdvanceDone = std::function<void(expected<std::int64_t, Problem>)>;
  /// Raises the mark to `token` without a write; the resulting mark, or 409 when lower.
  void advance(std::string memory_id, std::int64_t token, AdvanceDone done);

  /// The mark and current object of `memory_id` (a memory never seen: mark 0, no object).
  expected<FenceState, Problem> state(const std::string& memory_id);
  /// The current object, opened; 404 memory-not-found when there is none.
  expected<OpenObject, Problem> open(const std::string& memory_id);

  /// True when the database answers and the last commit did not fail.
  bool ready();
  /// Files in the pool right now (tests).
  std::size_t pooled();
  std::uint64_t max_object_size() const { return m_max_object_size; }

private:
  struct CommitJob {
    std::unique_ptr<Upload> upload;
    std::int64_t token;
    Precondition pre;
    CommitDone done;
  };
  struct AdvanceJob {
    std::string memory_id;
    std::int64_t token;
    AdvanceDone done;
  };
  using Job = std::variant<CommitJob, AdvanceJob>;

  void enqueue(Job job);
  void writer_loop();
  void run_batch(std::vector<Job>& batch);
  void sync_loop();
  void recover();
  /// A pool file's etag (its name), taken out of the pool; nullopt when the pool is empty.
  std::optional<std::string> take_pooled();
  /// Makes empty files until the pool is full, fsyncs the directory, then offers them.
  void refill_pool();
  /// Where the bytes of `memory_id`'s version `etag` are (or were, before the pool).
  std::filesystem::path version_path(const std::string& etag) const;
  std::filesystem::path legacy_version_path(const std::string& memory_id, const std::string& etag) const;
  std::unique_ptr<sqlite::Db> reader();
  /// The bytes of `memory_id`'s version `etag` when they are kept in its row.
  std::optional<std::string> inline_data(const std::string& memory_id, const std::string& etag);
  void give_back(std::unique_ptr<sqlite::Db> db);

  std::filesystem::path m_dir;
  std::filesystem::path m_objects;
  std::uint64_t m_max_object_size;
  int m_lock_fd = -1;
  int m_objects_fd = -1;
  std::unique_ptr<sqlite::Db> m_db; // the writer's

  std::mutex m_mutex; // the queues and m_stop
  std::condition_variable m_cv;
  std::deque<Job> m_queue;                     // durable uploads and advances, for the writer
  std::deque<CommitJob> m_sync_queue;          // uploads whose file is not fsynced yet
  std::deque<std::filesystem::path> m_garbage; // files no row names any more
  std::deque<std::string> m_pool;              // etags of empty files whose names are durable
  bool m_pool_wanted = false;                  // a syncer should refill the pool
  bool m_pool_refilling = false;
  std::condition_variable m_sync_cv;
  bool m_stop = false;        // the syncers stop
  bool m_writer_stop = false; // then the writer
  std::thread m_writer;
  std::vector<std::thread> m_syncers;

  std::mutex m_readers_mutex;
  std::vector<std::unique_ptr<sqlite::Db>> m_readers;
  std::atomic<bool> m_healthy{true};
};

/// "stale-fence" with the presented and the current token (SPEC §8).
Problem stale_fence(std::int64_t presented, std::int64_t current);

/// The problem for a failed system call on the data's disk: 507 for ENOSPC/EDQUOT, 503 else.
Problem disk_problem(int err, const std::string& what);

} // namespace mep::store
