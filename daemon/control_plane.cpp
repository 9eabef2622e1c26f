// Control-plane clients for mepd: embedded (the Router in-process) and remote (libcurl).
#include "mep/control_plane.hpp"

#include "mep/json.hpp"
#include "mep/router.hpp"
#include "mep/sqlite_store.hpp"

#include <boost/beast/http.hpp>
#include <boost/json/parse.hpp>
#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <mutex>
#include <sys/stat.h>
#include <vector>

namespace mep::daemon {
namespace http = boost::beast::http;

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
    server::HttpRequest req{http::string_to_verb(method), path, 11};
    req.set(http::field::authorization, "Bearer " + m_token);
    if (!body.empty()) req.set(http::field::content_type, "application/json");
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
    if (auto it = res.find(http::field::retry_after); it != res.end())
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

// ---- remote (libcurl) ------------------------------------------------------------------------

struct CurlGlobal {
  CurlGlobal() { curl_global_init(CURL_GLOBAL_DEFAULT); }
};

size_t on_body(char* p, size_t size, size_t n, void* user) {
  static_cast<std::string*>(user)->append(p, size * n);
  return size * n;
}

size_t on_header(char* p, size_t size, size_t n, void* user) {
  std::string_view line(p, size * n);
  constexpr std::string_view k = "retry-after:";
  if (line.size() > k.size()) {
    std::string lower(line.substr(0, k.size()));
    for (auto& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (lower == k) *static_cast<std::optional<int>*>(user) = std::atoi(std::string(line.substr(k.size())).c_str());
  }
  return size * n;
}

bool loopback_host(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "[::1]" || host == "::1";
}

class RemoteControlPlane final : public ControlPlane {
public:
  RemoteControlPlane(std::string url, std::string token) : m_url(std::move(url)), m_token(std::move(token)) {
    static CurlGlobal global;
    while (!m_url.empty() && m_url.back() == '/') m_url.pop_back();
    bool https = m_url.rfind("https://", 0) == 0;
    bool plain = m_url.rfind("http://", 0) == 0;
    if (!https && !plain) throw std::runtime_error("the control-plane URL must start with https:// or http://");
    if (plain) {
      std::string rest = m_url.substr(7);
      std::string host = rest.substr(0, rest.find_first_of("/"));
      if (host.front() == '[') host = host.substr(0, host.find(']') + 1);
      else host = host.substr(0, host.find(':'));
      if (!loopback_host(host))
        throw std::runtime_error("plain http:// is allowed for a loopback control plane only; use https://");
    }
    if (m_token.empty()) throw std::runtime_error("a remote control plane needs a token (--token-file or MEP_TOKEN)");
  }

  ~RemoteControlPlane() override {
    for (CURL* c : m_pool) curl_easy_cleanup(c);
  }

  CpReply request(std::string_view method, std::string_view path, const std::string& body,
                  const std::string& idempotency_key, std::chrono::milliseconds timeout) override {
    CURL* c = acquire();
    long total_ms = timeout.count() > 0 ? static_cast<long>(timeout.count()) : 10000L;
    CpReply r;
    std::string url = m_url + std::string(path);
    curl_slist* headers = nullptr;
    std::string auth = "Authorization: Bearer " + m_token;
    headers = curl_slist_append(headers, auth.c_str());
    headers = curl_slist_append(headers, "Content-Type: application/json");
    std::string idem = "Idempotency-Key: " + idempotency_key;
    if (!idempotency_key.empty()) headers = curl_slist_append(headers, idem.c_str());
    std::string m(method);
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, m.c_str());
    if (m == "POST") {
      curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
      curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
    }
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r.body);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &r.retry_after_s);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, std::min(3000L, total_ms));
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, total_ms);
    curl_easy_setopt(c, CURLOPT_SSLVERSION, static_cast<long>(CURL_SSLVERSION_TLSv1_3));
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    CURLcode rc = curl_easy_perform(c);
    if (rc == CURLE_OK) {
      long code = 0;
      curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
      r.status = static_cast<int>(code);
    } else {
      r.status = 0;
      r.error = curl_easy_strerror(rc);
      r.body.clear();
    }
    curl_slist_free_all(headers);
    release(c);
    return r;
  }

  std::string describe() const override { return m_url; }

private:
  CURL* acquire() {
    {
      std::lock_guard lock(m_mutex);
      if (!m_pool.empty()) {
        CURL* c = m_pool.back();
        m_pool.pop_back();
        return c;
      }
    }
    return curl_easy_init();
  }
  void release(CURL* c) {
    std::lock_guard lock(m_mutex);
    m_pool.push_back(c);
  }

  std::string m_url;
  std::string m_token;
  std::mutex m_mutex;
  std::vector<CURL*> m_pool;
};

} // namespace

std::unique_ptr<ControlPlane> make_embedded_control_plane(const std::filesystem::path& state_dir) {
  return std::make_unique<EmbeddedControlPlane>(state_dir);
}

std::unique_ptr<ControlPlane> make_remote_control_plane(const std::string& url, const std::string& token) {
  return std::make_unique<RemoteControlPlane>(url, token);
}

} // namespace mep::daemon
