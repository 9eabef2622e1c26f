// The peer users would pick instead of mep, measured in the same run: a private
// single-node etcd 3.4 (Debian's etcd-server) on loopback with its own data directory,
// driven over gRPC (C++, a thread per client, the clients multiplexed on one HTTP/2
// connection as etcd's clientv3 does, or one connection each: run()'s conns). gRPC, not etcd's JSON gateway: the
// gateway translates every call to gRPC inside etcd and would slow etcd down, flattering mep.
#pragma once
#include "stall_probe.hpp"

#include <filesystem>
#include <memory>
#include <string>
#include <sys/types.h>

namespace mep::bench {

struct EtcdResult {
  double ops_per_s = 0;
  double p50_ms = 0;
  double p99_ms = 0;
  long errors = 0;
  double client_cores = 0; ///< CPU of this process (the gRPC clients) ÷ wall time
  double server_cores = 0; ///< CPU of the etcd process ÷ wall time
  Stalls paused;           ///< pauses of the whole machine while the clients ran
};

/// CPU seconds (user + system) a process has used, from /proc/PID/stat.
double process_cpu_seconds(pid_t pid);

/// CPU seconds of a process and its children: its own, those of the children it has
/// reaped (cutime, cstime), and those of its live children (a PostgreSQL postmaster: every
/// backend, the WAL writer, the checkpointer).
double process_tree_cpu_seconds(pid_t pid);

/// Why etcd cannot be measured here (empty when it can): not built with gRPC, or no etcd
/// binary (`etcd` on PATH or $MEP_BENCH_ETCD).
std::string etcd_unavailable();

class EtcdPeer {
public:
  /// Starts etcd in `dir` (created) on free loopback ports and waits until it grants a
  /// lease. Throws std::runtime_error saying why it could not.
  explicit EtcdPeer(const std::filesystem::path& dir);
  ~EtcdPeer(); ///< SIGTERM by PID, SIGKILL after 5 s
  EtcdPeer(const EtcdPeer&) = delete;
  EtcdPeer& operator=(const EtcdPeer&) = delete;

  std::string version() const;
  pid_t pid() const;

  /// `clients` threads for `seconds`. Mode 0 (mep's claim+release cycle): LeaseGrant,
  /// Txn put-if-absent of the client's key under that lease (compare create_revision = 0),
  /// LeaseRevoke; one operation is the three calls. Mode 1 (mep's renew): one
  /// LeaseKeepAlive request and its answer on the client's stream. Mode 2 (a claim alone,
  /// next to mep's durable re-claim): LeaseGrant and Txn put-if-absent of a fresh key.
  /// Mode 3 (contended): Txn put-if-absent of a key about 4 clients share, under a lease
  /// granted for it; the winner revokes the lease, a loser keeps it for its next attempt.
  /// Mode 4 (next to mep's same-owner re-claim): one Txn that puts the client's own key
  /// again under its held lease if the key is still its own (value compare): a new
  /// mod_revision, etcd's fencing token, in one raft write.
  /// `conns`: gRPC connections the clients share (1: multiplexed on one, as clientv3 does;
  /// `clients`: one each); 0: $MEP_BENCH_ETCD_CONNS, else 1.
  EtcdResult run(int clients, double seconds, int mode, int conns = 0);

  /// `clients` threads that each, at the same instant, grant a lease and put a fresh key
  /// if absent under it (an agent's first claim), over `conns` shared connections: the
  /// seconds until the last is done; -1 when a call failed.
  double swarm(int clients, int conns);

private:
  struct Impl;
  std::unique_ptr<Impl> m;
};

} // namespace mep::bench
