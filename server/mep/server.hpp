// `mep server`: options and the main loop of the control plane.
#pragma once
#include "mep/store.hpp"

#include <cstdint>
#include <optional>
#include <string>

namespace mep::server {

inline constexpr const char* k_default_listen = "127.0.0.1:7878";
inline constexpr double k_default_rate_limit = 1000;
/// The commit thread's nice value (see StoreOptions::writer_nice): below the I/O threads'
/// and the clients' 0, when the process may.
inline constexpr int k_default_writer_nice = -10;

struct ServerOptions {
  std::string db_url;                    ///< empty: default_db_url()
  std::string listen = k_default_listen; ///< HOST:PORT; port 0 picks a free port
  std::string tls_cert;
  std::string tls_key;
  bool insecure_plaintext = false;          ///< allow plain HTTP beyond loopback
  double rate_limit = k_default_rate_limit; ///< requests/s per token; 0 = off
  std::string log_level = "info";
  int threads = 2;
  /// The ceiling on how long a lease may be held (--max-hold); nullopt: none.
  std::optional<std::int64_t> max_hold_s;
  StoreOptions store{.writer_nice = k_default_writer_nice}; ///< isolation, pool size, writer priority
};

/// Runs the server until SIGTERM/SIGINT; returns the process exit code (0 after a clean
/// shutdown, 2 for bad options, 1 when the database or the address cannot be used).
int run_server(const ServerOptions& options);

} // namespace mep::server
