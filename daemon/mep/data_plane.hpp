// How mepd reaches the data plane (`mep store` or any service with its API, SPEC §8): it
// advances the fence after each grant, uploads a file's bytes under the lease's token
// (sync) and downloads the latest object (fetch). Only memory ids and bytes go there; no
// path ever does.
#pragma once
#include "mep/expected.hpp"
#include "mep/http/client.hpp"
#include "mep/problem.hpp"

#include <cstdint>
#include <string>

namespace mep::daemon {

/// An object the store keeps (what a PUT or GET answered).
struct StoredObject {
  std::string memory_id;
  std::int64_t fencing_token = 0;
  std::string etag;
  std::uint64_t size = 0;
};

class DataPlane {
public:
  /// `url`: https://…, or http:// on loopback; `token`: the bearer token for it;
  /// `ca_file`: the certificates to trust instead of the system's. Throws
  /// std::runtime_error for a URL it refuses.
  DataPlane(const std::string& url, std::string token, const std::string& ca_file = {});

  /// Raises the store's mark for `memory_id` to `token`: the mark, 409 stale-fence when
  /// the store has seen a higher one, 503 store-unavailable when it cannot be reached.
  expected<std::int64_t, Problem> advance(const std::string& memory_id, std::int64_t token,
                                          std::chrono::milliseconds timeout = std::chrono::seconds(5));
  /// PUTs `size` bytes read from `fd` (from its current offset) with Fencing-Token `token`.
  expected<StoredObject, Problem> put(const std::string& memory_id, std::int64_t token, int fd, std::uint64_t size);
  /// GETs the latest object into `fd`; 404 memory-not-found when there is none.
  expected<StoredObject, Problem> get(const std::string& memory_id, int fd);

  const std::string& url() const { return m_url; }

private:
  Problem problem_of(const http::ClientResponse& r) const;
  std::string m_url;
  std::string m_token;
  http::Client m_client;
};

} // namespace mep::daemon
