#include "mep/token_cache.hpp"

#include <atomic>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::server {

TokenEpoch::TokenEpoch(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return;
  struct stat st {};
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
            (st.st_size >= static_cast<off_t>(sizeof(std::uint64_t)) ||
             ::ftruncate(fd, sizeof(std::uint64_t)) == 0);
  if (ok) {
    void* p = ::mmap(nullptr, sizeof(std::uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) m_word = static_cast<std::uint64_t*>(p);
  }
  ::close(fd);
}

TokenEpoch::~TokenEpoch() {
  if (m_word) ::munmap(m_word, sizeof(std::uint64_t));
}

std::optional<std::uint64_t> TokenEpoch::value() const {
  if (!m_word) return std::nullopt;
  return std::atomic_ref<std::uint64_t>(*m_word).load(std::memory_order_acquire);
}

bool TokenEpoch::bump() {
  if (!m_word) return false;
  std::atomic_ref<std::uint64_t>(*m_word).fetch_add(1, std::memory_order_acq_rel);
  return true;
}

std::optional<AuthInfo> TokenCache::find(const std::string& token_sha256) {
  auto epoch = m_epoch.value();
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
