// mepd's own state (SPEC §7), in state_dir/mepd.db: the daemon id, the path map, the
// memories this daemon registered, the leases it holds (for re-adoption after a restart)
// and its claim intents (exactly-once claims across crashes). All SQL of the daemon is here.
#pragma once
#include "mep/identity.hpp"
#include "mep/lease/types.hpp"
#include "mep/time.hpp"

#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <sys/types.h>
#include <utility>
#include <vector>

namespace mep::sqlite {
class Db;
}

namespace mep::daemon {

/// A held lease as it is kept on disk.
struct SavedLease {
  std::string canonical_name;
  std::string display_name;
  std::string memory_id;
  std::string lease_id;
  std::string owner_client_id;
  std::int64_t fencing_token = 0;
  std::int64_t ttl_s = 0;
  UnixMs expires_at = 0;
  std::string path;
  pid_t bind_pid = 0;
  uid_t uid = static_cast<uid_t>(-1); ///< the local user that attached it; -1: unknown
  gid_t gid = static_cast<gid_t>(-1);
};

/// A claim written down before it is sent: resent with the same key after a crash.
struct Intent {
  std::string key;
  lease::ClaimRequest request;
  std::string path;
  pid_t bind_pid = 0;                 ///< -1: the caller was told it failed; any lease won is released
  uid_t uid = static_cast<uid_t>(-1); ///< the local user that asked; -1: unknown
  gid_t gid = static_cast<gid_t>(-1);
};

/// How far a write must have gone when its call returns.
enum class Sync {
  /// On disk (fsync, synchronous=FULL): survives a power loss.
  durable,
  /// Committed to the WAL without an fsync (synchronous=NORMAL): survives the daemon's crash
  /// (kill -9) but not the host's. A power loss can take back only a suffix of the writes
  /// (the WAL is replayed in order up to its first torn frame), and the next durable write
  /// makes every earlier one durable too. For writes that a restart can do without because
  /// something durable already covers them (see save_lease, forget_lease).
  lazy,
};

/// Thread-safe. A read takes the connection's mutex for its statements only. Writes from
/// several threads at once share a transaction and its fsync (group commit: 64 agents
/// attaching at once were one fsync after another); a transaction is durable when any of its
/// writes asks for it. Every call may throw sqlite::Error (a full or read-only disk, a
/// deleted file): callers turn that into a 503 for new work and go on renewing what they hold.
class StateDb {
public:
  /// Opens (creating, upgrading) `path`. Throws std::runtime_error / sqlite::Error.
  explicit StateDb(const std::filesystem::path& path);
  ~StateDb();

  /// An opaque UUIDv7 minted once per state directory (the first half of owner ids).
  const std::string& daemon_id() const { return m_daemon_id; }

  // The path map: (path → memory id, device/inode/birth time, content SHA-256), one per
  // local user (`uid`: who the record was made for; rows from before have none and count as
  // the daemon's own user's). Lookups see the records of `uid` only.
  void remember_file(const std::string& memory_id, const std::string& path, const FileStat& st,
                     const std::optional<std::string>& sha256, uid_t uid);
  std::optional<std::string> memory_by_inode(const FileStat& st, uid_t uid);
  /// The distinct memories whose recorded content has this SHA-256 (at most 2: more is ambiguous).
  std::vector<std::string> memories_by_content(const std::string& sha256, uid_t uid);
  /// True when this host knows `memory_id` only as another local user's file (system mode:
  /// it is not attached or fetched for `uid`).
  bool memory_of_other_user(const std::string& memory_id, uid_t uid);

  /// Memories this daemon registered with (or had confirmed by) its control plane.
  bool registered(const std::string& memory_id);
  void mark_registered(const std::string& memory_id);

  /// Saves `l`; with `finished_intent`, the claim intent that won it goes in the same
  /// transaction. Lazy: until the next durable write, a power loss takes back both the row and
  /// the intent's delete, and the restart resends the (durable) intent under its key, which the
  /// control plane answers with the same grant for 24 h; the host's agents died with it.
  void save_lease(const SavedLease& l, const std::string& finished_intent = {});
  /// New expiries of held leases, in one transaction (one fsync for a renewal batch).
  void save_expiries(const std::vector<std::pair<std::string, UnixMs>>& expiries);
  /// Deletes the row of `canonical_name` (only while it holds `lease_id`, when one is given:
  /// a grant that replaced it stays). Lazy by default: a row brought back by a power loss is
  /// re-adopted, and its first renewal learns from the control plane that it ended.
  void forget_lease(const std::string& canonical_name, const std::string& lease_id = {}, Sync sync = Sync::lazy);
  std::vector<SavedLease> leases();

  void add_intent(const Intent& intent);
  void orphan_intent(const std::string& key);
  void delete_intent(const std::string& key);
  std::vector<Intent> intents();
  /// Whether the intent `key` is still there (the renewer asks just before resending it).
  bool has_intent(const std::string& key);

private:
  /// Runs `op` in the next transaction, with the writes of the other threads that queued
  /// while the one before committed. Returns once that transaction has committed as far as
  /// `sync` asks; throws what `op` threw (its changes undone, the batch's others kept) or what
  /// the commit threw (the whole batch undone).
  void write(const std::function<void(sqlite::Db&)>& op, Sync sync = Sync::durable);
  struct Pending;
  void commit(const std::vector<Pending*>& batch);

  std::mutex m_mutex; // the connection
  std::unique_ptr<sqlite::Db> m_db;
  std::string m_daemon_id;

  // What the hot path's reads found, so that they are not made again (an attach+detach made
  // three): a path's row as last read, and memories known registered (never unregistered).
  // At most k_known_files of each, forgotten all at once when full.
  struct KnownFile {
    std::string memory_id;
    std::uint64_t dev = 0, ino = 0;
    std::optional<std::int64_t> btime;
    std::optional<std::int64_t> uid; // none: a row from before there were several users
    std::optional<std::string> sha256;
    /// True when the row says this (the fingerprint `sha`: when one is given).
    bool says(const std::string& id, const FileStat& st, const std::optional<std::string>& sha, uid_t owner) const;
  };
  static constexpr std::size_t k_known_files = 16384;
  void known_registered(const std::string& memory_id);
  std::mutex m_cache_mutex; // taken before m_mutex, never after
  std::unordered_map<std::string, KnownFile> m_known_files;
  std::unordered_set<std::string> m_registered;

  std::mutex m_queue_mutex; // the writes waiting for the next transaction
  std::vector<Pending*> m_queue;
  bool m_committing = false; // a thread is committing, or has been named to commit the queue
  bool m_full = true;        // the connection's synchronous setting is FULL (else NORMAL)
};

} // namespace mep::daemon
