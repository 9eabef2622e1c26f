// Authentication results of the SQLite store, cached for a second and dropped at once when
// a token is revoked. A lookup in the database costs a read transaction (~13 µs of an I/O
// thread, a fifth of a renew's server time); a hit costs a mutex and a map probe.
//
// Revocation by another process (`mep token revoke` writes the database directly) must
// take effect for the next request, so the cache is keyed to a revocation epoch: a 64-bit
// counter in a small file beside the database (`<db>-token-epoch`, mode 0600), read with
// pread (not mapped: a file truncated under a mapping would kill the server with SIGBUS).
// `mep token revoke` increments it after its commit, under flock (so concurrent revokers
// never write a value the counter had before); an entry is used only while the counter
// still has the value it had before the entry's lookup began. The one-second lifetime
// bounds what the epoch cannot see: a revoking process killed between its commit and the
// increment, a hand-edited database, or an epoch file replaced under a running server.
#pragma once
#include "mep/store.hpp"

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace mep::server {

class TokenEpoch {
public:
  /// Opens `path` (creating it, 0600). Without a usable file the epoch is unavailable:
  /// value() is empty and nothing may be cached.
  explicit TokenEpoch(const std::string& path);
  ~TokenEpoch();
  TokenEpoch(const TokenEpoch&) = delete;
  TokenEpoch& operator=(const TokenEpoch&) = delete;

  std::optional<std::uint64_t> value() const;
  /// Increments the counter; false when the file is unusable.
  bool bump();

private:
  int m_fd = -1;
};

class TokenCache {
public:
  static constexpr std::chrono::milliseconds k_lifetime{1000};
  static constexpr std::size_t k_capacity = 4096;

  explicit TokenCache(const std::string& epoch_path, std::chrono::milliseconds lifetime = k_lifetime)
      : m_epoch(epoch_path), m_lifetime(lifetime) {}

  /// The current epoch: read it before find(), and pass the same value to put() after a
  /// miss's lookup in the database.
  std::optional<std::uint64_t> epoch() const { return m_epoch.value(); }
  /// The token's result cached under `epoch` and still young, or a miss.
  std::optional<AuthInfo> find(const std::string& token_sha256, std::optional<std::uint64_t> epoch);
  void put(const std::string& token_sha256, const AuthInfo& info, std::optional<std::uint64_t> epoch);
  /// Tells every process that has the store open to forget cached tokens.
  bool invalidate() { return m_epoch.bump(); }

private:
  struct Entry {
    AuthInfo info;
    std::uint64_t epoch;
    std::chrono::steady_clock::time_point until;
  };
  TokenEpoch m_epoch;
  std::chrono::milliseconds m_lifetime;
  std::mutex m_mutex;
  std::unordered_map<std::string, Entry> m_entries;
};

} // namespace mep::server
