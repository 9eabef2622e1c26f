// Per-file mutual exclusion inside mepd: an attach resolves (and may mint) a file's memory
// identity under its file's lock, so two attaches of one file never mint two identities.
// Locks are kept by key (device:inode, or the path) and forgotten once no one holds or
// waits for them, so the table does not grow with every file seen.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace mep::daemon {

class FileLocks {
public:
  /// A held lock. It owns its mutex together with the table, so the table cannot forget
  /// (destroy) a mutex while it is held; the lock is released before that share.
  struct Held {
    std::shared_ptr<std::mutex> mutex; // first: destroyed after the lock below
    std::unique_lock<std::mutex> lock;
  };

  /// Blocks until the lock of `key` is this caller's.
  Held lock(const std::string& key) {
    std::shared_ptr<std::mutex> m;
    {
      std::lock_guard guard(m_mutex);
      auto& slot = m_locks[key];
      if (!slot) slot = std::make_shared<std::mutex>();
      m = slot;
      // Forget the locks no one holds or waits for: only the table still shares them.
      for (auto it = m_locks.begin(); it != m_locks.end();)
        it = it->second.use_count() == 1 ? m_locks.erase(it) : std::next(it);
    }
    Held held{m, std::unique_lock<std::mutex>(*m)};
    return held;
  }

  /// How many locks the table keeps (for tests).
  std::size_t size() const {
    std::lock_guard guard(m_mutex);
    return m_locks.size();
  }

private:
  mutable std::mutex m_mutex;
  std::map<std::string, std::shared_ptr<std::mutex>> m_locks;
};

} // namespace mep::daemon
