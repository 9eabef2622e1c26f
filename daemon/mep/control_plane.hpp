// How mepd reaches the control plane: a remote `mep server` over HTTP(S), or the same
// engine embedded in-process on a local SQLite file (single-host mode). Both offer the
// typed operations below, so the daemon behaves the same either way and knows no JSON.
#pragma once
#include "mep/expected.hpp"
#include "mep/lease/types.hpp"
#include "mep/problem.hpp"

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace mep::daemon {

/// The problem for a control plane that gave no answer at all (refused, timed out):
/// 503 unavailable with Retry-After: 1.
Problem unreachable(std::string why);

/// True when a failure does not say what happened — no answer, a 5xx, or a duplicate
/// still in flight: the request may or may not have taken effect.
bool outcome_unknown(const Problem& p);

/// How long a claim may wait for a held name or memory (Prefer: wait on the server), and
/// how the caller says it stopped waiting (its agent went away).
struct ClaimWait {
  std::chrono::seconds wait{0}; ///< 0: answer at once; at most the server's 300 s
  std::function<bool()> cancelled;
};

/// Every call is thread-safe, blocks for at most its timeout (default 10 s remote, 30 s
/// embedded) and never throws for transport failures (they are `unreachable` problems).
class ControlPlane {
public:
  virtual ~ControlPlane() = default;
  /// POST /v1/memories with a client-minted id (idempotent for the tenant that has it).
  virtual expected<lease::Registered, Problem> register_memory(const std::string& memory_id) = 0;
  /// POST /v1/leases under `idempotency_key`; with a wait, the call blocks up to that long
  /// more than its timeout, or until `cancelled` says so (then it is `unreachable`).
  virtual expected<lease::Grant, Problem> claim(const lease::ClaimRequest& req, const std::string& idempotency_key,
                                                const ClaimWait& wait = {}) = 0;
  virtual expected<lease::RenewBatchResult, Problem> renew_batch(const lease::RenewBatchRequest& req,
                                                                 std::chrono::milliseconds timeout) = 0;
  virtual expected<void, Problem> release(const lease::LeaseRef& ref) = 0;
  /// POST /v1/memories/branch; the key makes a retry replay.
  virtual expected<lease::Branched, Problem> branch(const lease::BranchRequest& req,
                                                    const std::string& idempotency_key) = 0;
  virtual expected<lease::Memory, Problem> memory(const std::string& memory_id) = 0;
  virtual expected<lease::Lineage, Problem> lineage(const std::string& memory_id) = 0;
  virtual expected<lease::Verified, Problem> verify(const lease::VerifyRequest& req) = 0;
  virtual expected<lease::IdentityMapPage, Problem> identity_map(const std::optional<std::string>& cursor,
                                                                 std::size_t limit) = 0;
  /// "embedded (sqlite:…)" or the URL, for logs and /healthz.
  virtual std::string describe() const = 0;
};

/// The embedded engine on `state_dir`/control.db with a local tenant and token (kept in
/// `state_dir`/embedded.token, mode 0600). Throws std::runtime_error.
std::unique_ptr<ControlPlane> make_embedded_control_plane(const std::filesystem::path& state_dir);

/// A remote control plane at `url` (https://…, or http:// on a loopback address only)
/// with a bearer token. TLS 1.3 with certificate verification, against `ca_file`'s
/// certificates when given (else the system's). Throws std::runtime_error for a URL it
/// refuses.
std::unique_ptr<ControlPlane> make_remote_control_plane(const std::string& url, const std::string& token,
                                                        const std::string& ca_file = {});

} // namespace mep::daemon
