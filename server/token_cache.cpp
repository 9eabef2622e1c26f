#include "mep/token_cache.hpp"

#include <chrono>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::server {

TokenEpoch::TokenEpoch(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return;
  struct stat st {};
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
            (st.st_size >= static_cast<off_t>(sizeof(std::uint64_t)) || ::ftruncate(fd, sizeof(std::uint64_t)) == 0);
  if (!ok) {
    ::close(fd);
    return;
  }
  m_fd = fd;
}

TokenEpoch::~TokenEpoch() {
  if (m_fd >= 0) ::close(m_fd);
}

namespace {
std::optional<std::uint64_t> read_word(int fd) {
  std::uint64_t v = 0;
  if (::pread(fd, &v, sizeof v, 0) != static_cast<ssize_t>(sizeof v)) return std::nullopt;
  return v;
}
} // namespace

std::optional<std::uint64_t> TokenEpoch::value() const {
  if (m_fd < 0) return std::nullopt;
  return read_word(m_fd);
}

bool TokenEpoch::bump() {
  if (m_fd < 0 || ::flock(m_fd, LOCK_EX) != 0) return false;
  // An unreadable (truncated) counter restarts from the clock, above any value the
  // counter had, so no entry cached at an earlier value becomes valid again.
  auto v = read_word(m_fd);
  std::uint64_t next = v ? *v + 1
                         : static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                          std::chrono::system_clock::now().time_since_epoch())
                                                          .count());
  bool ok = ::pwrite(m_fd, &next, sizeof next, 0) == static_cast<ssize_t>(sizeof next);
  ::flock(m_fd, LOCK_UN);
  return ok;
}

std::optional<AuthInfo> TokenCache::find(const std::string& token_sha256, std::optional<std::uint64_t> epoch) {
  if (!epoch) return std::nullopt;
  auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(m_mutex);
  auto it = m_entries.find(token_sha256);
  if (it == m_entries.end()) return std::nullopt;
  if (it->second.epoch != *epoch || now >= it->second.until) {
    m_entries.erase(it);
    return std::nullopt;
  }
  return it->second.info;
}

void TokenCache::put(const std::string& token_sha256, const AuthInfo& info, std::optional<std::uint64_t> epoch) {
  if (!epoch) return;
  auto until = std::chrono::steady_clock::now() + m_lifetime;
  std::lock_guard lock(m_mutex);
  if (m_entries.size() >= k_capacity) m_entries.clear();
  m_entries.insert_or_assign(token_sha256, Entry{info, *epoch, until});
}

} // namespace mep::server
