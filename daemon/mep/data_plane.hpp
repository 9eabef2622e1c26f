// How mepd reaches the data plane (`mep store` or any service with its API, SPEC §8): it
// advances the fence after each grant, uploads a file's bytes under the lease's token
// (sync) and downloads the latest object (fetch). Only memory ids and bytes go there; no
// path ever does.
#pragma once
#include "mep/expected.hpp"
#include "mep/http/client.hpp"
#include "mep/problem.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace mep::daemon {

/// An object the store keeps (what a PUT or GET answered).
struct StoredObject {
  std::string memory_id;
  std::int64_t fencing_token = 0;
  std::string etag;
  std::uint64_t size = 0;
};

/// The data plane as the keeper uses it. Calls are thread-safe, block for at most their
/// timeout and never throw for transport failures (they are `store-unavailable`). The
/// keeper's unit tests put a fake behind it.
class DataPlane {
public:
  virtual ~DataPlane() = default;
  /// Raises the store's mark for `memory_id` to `token`: the mark, 409 stale-fence when
  /// the store has seen a higher one, 503 store-unavailable when it cannot be reached.
  virtual expected<std::int64_t, Problem> advance(const std::string& memory_id, std::int64_t token,
                                                  std::chrono::milliseconds timeout = std::chrono::seconds(5)) = 0;
  /// PUTs `size` bytes read from `fd` (from its current offset) with Fencing-Token `token`.
  virtual expected<StoredObject, Problem> put(const std::string& memory_id, std::int64_t token, int fd,
                                              std::uint64_t size) = 0;
  /// GETs the latest object into `fd`; 404 memory-not-found when there is none.
  virtual expected<StoredObject, Problem> get(const std::string& memory_id, int fd) = 0;
  /// Where it is, for /healthz (no token, no path).
  virtual const std::string& url() const = 0;
};

/// The data plane at `url` (https://…, or http:// on loopback) over HTTP with `token`, its
/// bearer token; `ca_file`: the certificates to trust instead of the system's. Throws
/// std::runtime_error for a URL it refuses or an empty token.
std::unique_ptr<DataPlane> make_remote_data_plane(const std::string& url, std::string token,
                                                  const std::string& ca_file = {});

} // namespace mep::daemon
