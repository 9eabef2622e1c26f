// `mep store`: the reference fenced object store (SPEC §8) — options and the main loop.
#pragma once
#include <cstdint>
#include <string>

namespace mep::store {

inline constexpr const char* k_default_listen = "127.0.0.1:7879";
inline constexpr std::uint64_t k_default_max_object_size = std::uint64_t{1} << 30; // 1 GiB

struct StoreServerOptions {
  std::string listen = k_default_listen; ///< HOST:PORT; port 0 picks a free port
  std::string dir;                       ///< empty: $XDG_STATE_HOME/mep/store
  std::string token_file;                ///< SHA-256 (hex) of each accepted bearer token, one per line
  bool strict = false;                   ///< check every request with the control plane
  std::string control_plane;             ///< its URL, for --strict
  std::string ca_file;                   ///< PEM certificates to trust for it (else the system's)
  std::uint64_t max_object_size = k_default_max_object_size;
  std::string tls_cert;
  std::string tls_key;
  bool insecure_plaintext = false; ///< plain HTTP beyond loopback (behind a TLS proxy)
  std::string log_level = "info";
  int threads = 2;
};

/// The default data directory: $XDG_STATE_HOME/mep/store.
std::string default_store_dir();

/// Runs the store until SIGTERM/SIGINT; returns the process exit code (0 after a clean
/// shutdown, 2 for bad options, 1 when the directory or the address cannot be used).
int run_store(const StoreServerOptions& options);

} // namespace mep::store
