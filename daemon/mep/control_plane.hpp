// How mepd reaches the control plane: a remote `mep server` over HTTP(S) (libcurl), or
// the same engine embedded in-process on a local SQLite file (single-host mode). Both
// speak the HTTP API of SPEC §6, so the daemon behaves the same either way.
#pragma once
#include <boost/json/object.hpp>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace mep::daemon {

/// One answer from the control plane. `status` is 0 when the request did not get an
/// HTTP answer at all (connection refused, timeout); `error` then says why.
struct CpReply {
  int status = 0;
  std::string body;
  std::optional<int> retry_after_s;
  std::string error;

  bool ok() const { return status >= 200 && status < 300; }
  /// The body as a JSON object (empty when it is not one).
  boost::json::object json() const;
  /// The problem `code` of an error body, or "unavailable" when there was no answer.
  std::string code() const;
};

class ControlPlane {
public:
  virtual ~ControlPlane() = default;
  /// Sends one request; thread-safe; never throws for transport errors. `timeout` bounds
  /// the whole exchange (0: the default, 10 s remote / 30 s embedded); past it the reply
  /// has status 0.
  virtual CpReply request(std::string_view method, std::string_view path, const std::string& body,
                          const std::string& idempotency_key = {},
                          std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) = 0;
  /// "embedded (sqlite:…)" or the URL, for logs and /healthz.
  virtual std::string describe() const = 0;
};

/// The embedded engine on `state_dir`/control.db with a local tenant and token (kept in
/// `state_dir`/embedded.token, mode 0600). Throws std::runtime_error.
std::unique_ptr<ControlPlane> make_embedded_control_plane(const std::filesystem::path& state_dir);

/// A remote control plane at `url` (https://…, or http:// on a loopback address only)
/// with a bearer token. TLS 1.3 with certificate verification. Throws std::runtime_error
/// for a URL it refuses.
std::unique_ptr<ControlPlane> make_remote_control_plane(const std::string& url, const std::string& token);

} // namespace mep::daemon
