// Control-plane clients for mepd: embedded (the Router in-process) and remote (libcurl).
#include "mep/control_plane.hpp"

#include "mep/http/client.hpp"
#include "mep/json.hpp"
#include "mep/router.hpp"
#include "mep/sqlite_store.hpp"

#include <boost/beast/http.hpp>
#include <boost/json/parse.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <mutex>
#include <sys/stat.h>
#include <vector>

namespace mep::daemon {
namespace bhttp = boost::beast::http;

boost::json::object CpReply::json() const {
  boost::system::error_code ec;
  auto v = boost::json::parse(body, ec);
  if (ec || !v.is_object()) return {};
  return std::move(v.get_object());
}

std::string CpReply::code() const {
  if (status == 0) return "unavailable";
  auto o = json();
  if (auto* c = o.if_contains("code"); c && c->is_string()) return std::string(c->get_string());
  return std::to_string(status);
}

namespace {

// ---- embedded ------------------------------------------------------------------------------

class EmbeddedControlPlane final : public ControlPlane {
public:
  explicit EmbeddedControlPlane(const std::filesystem::path& dir)
      : m_store(std::make_unique<server::SqliteStore>("sqlite:" + (dir / "control.db").string())),
        m_router(*m_store, 0) {
    auto token_file = dir / "embedded.token";
    std::ifstream in(token_file);
    std::getline(in, m_token);
    if (m_token.rfind("mep_", 0) != 0) {
      m_token = m_store->create_token("local", server::Scope::admin).second;
      mode_t old = ::umask(077); // the token file is created 0600; the process umask is restored
      {
        std::ofstream out(token_file, std::ios::trunc);
        out << m_token << "\n";
      }
      ::umask(old);
      ::chmod(token_file.c_str(), 0600);
    }
    m_describe = "embedded (sqlite:" + (dir / "control.db").string() + ")";
  }

  CpReply request(std::string_view method, std::string_view path, const std::string& body,
                  const std::string& idempotency_key, std::chrono::milliseconds timeout) override {
    server::HttpRequest req{bhttp::string_to_verb(method), path, 11};
    req.set(bhttp::field::authorization, "Bearer " + m_token);
    if (!body.empty()) req.set(bhttp::field::content_type, "application/json");
    if (!idempotency_key.empty()) req.set("Idempotency-Key", idempotency_key);
    req.body() = body;
    req.prepare_payload();
    auto promise = std::make_shared<std::promise<server::HttpResponse>>();
    auto future = promise->get_future();
    m_router.handle(std::move(req), server::Peer{true},
                    [promise](server::HttpResponse&& res) { promise->set_value(std::move(res)); });
    if (future.wait_for(timeout.count() > 0 ? timeout : std::chrono::milliseconds(30000)) != std::future_status::ready)
      return CpReply{0, {}, {}, "the embedded control plane did not answer in time"};
    auto res = future.get();
    CpReply r;
    r.status = static_cast<int>(res.result_int());
    r.body = res.body();
    if (auto it = res.find(bhttp::field::retry_after); it != res.end())
      r.retry_after_s = std::atoi(std::string(it->value()).c_str());
    return r;
  }

  std::string describe() const override { return m_describe; }

private:
  std::unique_ptr<server::Store> m_store;
  server::Router m_router;
  std::string m_token;
  std::string m_describe;
};

// ---- remote ---------------------------------------------------------------------------------

class RemoteControlPlane final : public ControlPlane {
public:
  RemoteControlPlane(std::string url, std::string token)
      : m_url(http::checked_base_url(std::move(url), "control-plane URL")), m_token(std::move(token)) {
    if (m_token.empty()) throw std::runtime_error("a remote control plane needs a token (--token-file or MEP_TOKEN)");
  }

  CpReply request(std::string_view method, std::string_view path, const std::string& body,
                  const std::string& idempotency_key, std::chrono::milliseconds timeout) override {
    http::ClientRequest req;
    req.method = std::string(method);
    req.url = m_url + std::string(path);
    req.headers = {{"Authorization", "Bearer " + m_token}, {"Content-Type", "application/json"}};
    if (!idempotency_key.empty()) req.headers.emplace_back("Idempotency-Key", idempotency_key);
    req.body = body;
    if (timeout.count() > 0) req.timeout = timeout;
    auto res = m_client.perform(req);
    CpReply r;
    r.status = res.status;
    r.error = std::move(res.error);
    if (r.status) r.body = std::move(res.body);
    r.retry_after_s = res.retry_after();
    return r;
  }

  std::string describe() const override { return m_url; }

private:
  std::string m_url;
  std::string m_token;
  http::Client m_client;
};

} // namespace

std::unique_ptr<ControlPlane> make_embedded_control_plane(const std::filesystem::path& state_dir) {
  return std::make_unique<EmbeddedControlPlane>(state_dir);
}

std::unique_ptr<ControlPlane> make_remote_control_plane(const std::string& url, const std::string& token) {
  return std::make_unique<RemoteControlPlane>(url, token);
}

} // namespace mep::daemon
