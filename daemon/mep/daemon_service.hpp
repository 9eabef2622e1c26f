// What mepd does for its agents, as one interface: the calls its socket API (SPEC §7, §8)
// routes to. The Keeper implements it; the request handler (daemon_handler.hpp) depends
// only on this, so its decoding and encoding are tested, and fuzzed, on a fake.
#pragma once
#include "mep/daemon_api.hpp"
#include "mep/expected.hpp"
#include "mep/lease/types.hpp"
#include "mep/lease_book.hpp"
#include "mep/problem.hpp"

#include <boost/json/object.hpp>

#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

namespace mep::daemon {

struct AttachRequest {
  std::string name; ///< display name
  std::filesystem::path path;
  std::int64_t ttl_s = lease::k_default_ttl_s;
  bool bind_pid = true;
  pid_t pid = 0;                      ///< the peer's pid (SO_PEERCRED)
  uid_t uid = static_cast<uid_t>(-1); ///< the peer's uid and gid: the lease's local owner
  gid_t gid = static_cast<gid_t>(-1);
  /// How long to wait for a held name or memory (0: fail fast with 423). Waits longer than
  /// the server's 300 s are several waits in a row.
  std::chrono::seconds wait{0};
  /// True once the agent that asked has gone: the wait ends (and leaves the server's queue).
  std::function<bool()> cancelled;
  /// The agent's labels for its holder (sorted by key), and its executable's file name when
  /// the peer only launches it (mep run); empty: the daemon reads the peer's own.
  std::vector<std::pair<std::string, std::string>> labels;
  std::string exe;
  /// Renewals stop this long after the grant (max_hold_seconds); nullopt: the server's ceiling.
  std::optional<std::int64_t> max_hold_s;
};

/// What a detach did besides ending the lease here.
struct Detached {
  /// Why the control plane did not confirm the release (unreachable, the lease superseded or
  /// expired there, this daemon's token refused); nullopt: it did.
  std::optional<Problem> control_plane;
};

/// Requests from a local peer: `viewer` is its uid. A peer sees and acts on only the leases
/// it attached (root and the daemon's own user on all: may_act_on); another's is 404. File
/// calls run with the current peer's credentials (peer.hpp: AsPeer). Every path is absolute
/// and lexically normal (the handler resolves a relative one against the peer's working
/// directory).
class DaemonService {
public:
  virtual ~DaemonService() = default;

  /// Claims `name` for the file's memory; with a data plane, advances its fence before it
  /// answers (503 store-unavailable, and the lease given back, when it cannot). A peer that
  /// is not the daemon's own user must be able to open the file for writing itself (403).
  virtual expected<Held, Problem> attach(const AttachRequest& req) = 0;
  /// Releases the lease under `name` (only the one with `lease_id`, when given). The lease
  /// ends here in any case; Detached::control_plane says why the control plane did not
  /// confirm it, when it did not.
  virtual expected<Detached, Problem> detach(const std::string& name, const std::optional<std::string>& lease_id,
                                             uid_t viewer) = 0;
  virtual std::vector<Held> list(uid_t viewer) const = 0;
  virtual expected<Held, Problem> get(const std::string& name, uid_t viewer) const = 0;
  /// Copies the memory at `path` to `new_path` (created with the source's mode within
  /// `mode`, the client's umask applied) as a new memory branched from it.
  virtual expected<BranchedFile, Problem> branch(const std::filesystem::path& path,
                                                 const std::filesystem::path& new_path, uid_t viewer, mode_t mode) = 0;
  virtual expected<Identified, Problem> identify(const std::filesystem::path& path) = 0;
  virtual expected<Initialized, Problem> init(const std::filesystem::path& path, mode_t mode) = 0;
  /// The lineage of the memory at `path`, or of the memory id `id`.
  virtual expected<lease::Lineage, Problem> lineage(const std::optional<std::filesystem::path>& path,
                                                    const std::string& id) = 0;
  /// Asks the control plane whether the lease under `name` is still the live one. With
  /// `lease_id`, only that lease: another under the name since is 404 lease-not-found.
  virtual expected<VerifiedLease, Problem> verify(const std::string& name, const std::optional<std::string>& lease_id,
                                                  uid_t viewer) = 0;
  /// Uploads the lease's file to the data plane with its token; refused locally (nothing
  /// sent) when the lease is not live, or (`lease_id`) not that lease.
  virtual expected<ObjectResult, Problem> sync(const std::string& name, const std::optional<std::string>& lease_id,
                                               uid_t viewer) = 0;
  /// Downloads the latest object of `memory_id` into the new file `path` (created with
  /// `mode`) and binds that file to the memory's identity.
  virtual expected<ObjectResult, Problem> fetch(const std::string& memory_id, const std::filesystem::path& path,
                                                mode_t mode) = 0;

  virtual boost::json::object health() const = 0;
  virtual std::string metrics() const = 0;

  /// Registers an event sink (one NDJSON line per call, newline included) for the events of
  /// the leases `viewer` may see; returns its id.
  virtual int subscribe(std::function<void(const std::string&)> sink, uid_t viewer) = 0;
  virtual void unsubscribe(int id) = 0;
};

} // namespace mep::daemon
