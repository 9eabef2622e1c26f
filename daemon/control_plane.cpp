// Control-plane clients for mepd: remote (libcurl, the HTTP API of SPEC §6) and embedded
// (the lease service in-process, called directly). The remote one's typed operations, their
// wire forms and the problem of a failed answer are written once, in HttpControlPlane.
#include "mep/control_plane.hpp"

#include "mep/crypto.hpp"
#include "mep/http/client.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/lease_service.hpp"
#include "mep/log.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/sweeper.hpp"
#include "mep/uuid.hpp"

#include <boost/json/parse.hpp>

#include <atomic>
#include <cctype>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <future>
#include <mutex>
#include <vector>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::daemon {
namespace wire = lease::wire;

Problem unreachable(std::string why) {
  Problem p(Code::control_plane_unreachable, "the control plane is unreachable: " + why);
  p.retry_after_s = 1;
  return p;
}

bool outcome_unknown(const Problem& p) { return outcome_may_be_unknown(p.code); }

namespace {

// One answer as it came: status 0 when there was none.
struct Raw {
  int status = 0;
  std::string body;
  std::optional<int> retry_after;
  std::string error;
  std::int64_t waited_ms = 0; ///< Mep-Waited-Ms of a claim that waited
};

std::int64_t waited_header(std::string_view v) {
  std::int64_t n = 0;
  for (char ch : v) {
    if (ch < '0' || ch > '9' || n > (std::int64_t{1} << 40)) return 0;
    n = n * 10 + (ch - '0');
  }
  return n;
}

class HttpControlPlane : public ControlPlane {
public:
  expected<lease::Registered, Problem> register_memory(const std::string& memory_id) override {
    return call<lease::Registered>("POST", "/v1/memories", wire::to_json(lease::RegisterRequest{memory_id}),
                                   "register-" + memory_id, {}, wire::decode_registered);
  }

  expected<lease::Grant, Problem> claim(const lease::ClaimRequest& req, const std::string& key,
                                        const ClaimWait& wait) override {
    if (wait.wait.count() <= 0) return claim_together(req, key);
    // The server answers within the wait; the exchange may take that long and then some.
    Extra extra{"wait=" + std::to_string(wait.wait.count()), wait.cancelled};
    std::int64_t waited = 0;
    auto g = call<lease::Grant>("POST", "/v1/leases", wire::to_json(req), key, wait.wait + std::chrono::seconds(15),
                                wire::decode_grant, extra, &waited);
    if (g) g->waited_ms = waited;
    return g;
  }

  expected<lease::RenewBatchResult, Problem> renew_batch(const lease::RenewBatchRequest& req,
                                                         std::chrono::milliseconds timeout) override {
    return call<lease::RenewBatchResult>("POST", "/v1/leases/renew-batch", wire::to_json(req), {}, timeout,
                                         wire::decode_renew_batch_result);
  }

  expected<void, Problem> release(const lease::LeaseRef& ref) override {
    Raw r = exchange("POST", "/v1/leases/release", json::dump(wire::to_json(ref, wire::RefForm::release)), {}, {}, {});
    if (r.status >= 200 && r.status < 300) return {};
    return make_unexpected(problem_of(r));
  }

  expected<lease::Branched, Problem> branch(const lease::BranchRequest& req, const std::string& key) override {
    return call<lease::Branched>("POST", "/v1/memories/branch", wire::to_json(req), key, {}, wire::decode_branched);
  }

  expected<lease::Memory, Problem> memory(const std::string& memory_id) override {
    return call<lease::Memory>("GET", "/v1/memories/" + memory_id, std::nullopt, {}, {}, wire::decode_memory);
  }

  expected<lease::Lineage, Problem> lineage(const std::string& memory_id) override {
    return call<lease::Lineage>("GET", "/v1/memories/" + memory_id + "/lineage", std::nullopt, {}, {},
                                wire::decode_lineage);
  }

  expected<lease::Verified, Problem> verify(const lease::VerifyRequest& req) override {
    return call<lease::Verified>("POST", "/v1/fence/verify", wire::to_json(req), {}, {}, wire::decode_verified);
  }

  expected<lease::IdentityMapPage, Problem> identity_map(const std::optional<std::string>& cursor,
                                                         std::size_t limit) override {
    std::string target = "/v1/migration/identity-map?limit=" + std::to_string(limit);
    if (cursor) {
      static constexpr char hex[] = "0123456789ABCDEF";
      target += "&cursor=";
      for (unsigned char ch : *cursor) {
        if (std::isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~')
          target.push_back(static_cast<char>(ch));
        else
          target += {'%', hex[ch >> 4], hex[ch & 0xF]};
      }
    }
    return call<lease::IdentityMapPage>("GET", target, std::nullopt, {}, {}, wire::decode_identity_map_page);
  }

protected:
  /// What a waiting claim adds to its exchange: a Prefer value and a way to give up.
  struct Extra {
    std::string prefer;
    std::function<bool()> cancelled;
  };
  /// Sends one request; status 0 when there was no answer.
  virtual Raw exchange(std::string_view method, const std::string& target, const std::string& body,
                       const std::string& idempotency_key, std::chrono::milliseconds timeout, const Extra& extra) = 0;

private:
  // Claims without a wait go together (a swarm of agents attaching at once through this
  // daemon): up to k_claim_senders sends are on their way at a time, each of one claim or
  // of all that queued before it (up to k_max_claim_batch, in one POST
  // /v1/leases/claim-batch, each decided as if alone under its own key). A claim that
  // finds every sender busy queues; a sender whose answer is in hands its turn to the
  // first in the queue, which sends everything queued by then. More than one sender, so
  // that one slow exchange (a resend of an intent to a control plane that does not answer
  // it, up to its timeout) does not hold every other agent's claim behind it.
  static constexpr int k_claim_senders = 4;

  struct Waiting {
    const lease::ClaimRequest* req;
    const std::string* key;
    std::optional<expected<lease::Grant, Problem>> result;
    bool lead = false;
  };

  expected<lease::Grant, Problem> claim_together(const lease::ClaimRequest& req, const std::string& key) {
    Waiting me{&req, &key, std::nullopt, false};
    std::unique_lock lock(m_claims_mutex);
    if (m_claim_senders < k_claim_senders) {
      ++m_claim_senders;
    } else {
      m_claims.push_back(&me);
      m_claims_cv.wait(lock, [&] { return me.result.has_value() || me.lead; });
      if (me.result) return std::move(*me.result);
    }
    // This caller holds a sender's turn: it sends its claim and all that queued.
    std::vector<Waiting*> batch{&me};
    while (!m_claims.empty() && batch.size() < lease::k_max_claim_batch) {
      batch.push_back(m_claims.front());
      m_claims.pop_front();
    }
    lock.unlock();
    std::vector<expected<lease::Grant, Problem>> results = send_claims(batch);
    lock.lock();
    for (std::size_t i = 0; i < batch.size(); ++i) batch[i]->result = std::move(results[i]);
    if (m_claims.empty()) {
      --m_claim_senders;
    } else {
      m_claims.front()->lead = true; // the turn passes on: it sends what queued meanwhile
      m_claims.pop_front();
    }
    m_claims_cv.notify_all();
    return std::move(*me.result);
  }

  // One claim alone (POST /v1/leases), or several in one claim-batch; a control plane that
  // does not know claim-batch (an older mep server: 404 or 405) gets them one by one.
  std::vector<expected<lease::Grant, Problem>> send_claims(const std::vector<Waiting*>& batch) {
    std::vector<expected<lease::Grant, Problem>> out;
    auto one_by_one = [&] {
      for (const Waiting* w : batch)
        out.push_back(
            call<lease::Grant>("POST", "/v1/leases", wire::to_json(*w->req), *w->key, {}, wire::decode_grant));
      return out;
    };
    if (batch.size() == 1 || m_no_claim_batch) return one_by_one();
    boost::json::array claims;
    for (const Waiting* w : batch) {
      boost::json::object c = wire::to_json(*w->req);
      c["idempotency_key"] = *w->key;
      claims.emplace_back(std::move(c));
    }
    Raw r = exchange("POST", "/v1/leases/claim-batch", json::dump(boost::json::object{{"claims", std::move(claims)}}),
                     {}, {}, {});
    if (r.status == 404 || r.status == 405) {
      m_no_claim_batch = true;
      log::info("the control plane has no claim-batch: claims go one by one");
      return one_by_one();
    }
    const boost::json::array* results = nullptr;
    std::optional<boost::json::object> doc;
    if (r.status == 200) {
      doc = json::parse_object(r.body).value_or(boost::json::object{});
      if (auto* a = doc->if_contains("results"); a && a->is_array() && a->get_array().size() == batch.size())
        results = &a->get_array();
    }
    if (!results) {
      // No answer, or not one per claim: every claim's outcome is unknown (each is resent
      // under its own key) or, for a refusal of the whole request, that refusal.
      const Problem p = r.status == 200 ? answer_unreadable(r) : problem_of(r);
      for (std::size_t i = 0; i < batch.size(); ++i) out.push_back(make_unexpected(p));
      return out;
    }
    for (const auto& v : *results) {
      const auto* item = v.if_object();
      const auto* status = item ? item->if_contains("status") : nullptr;
      const auto* lease = item ? item->if_contains("lease") : nullptr;
      const auto* problem = item ? item->if_contains("problem") : nullptr;
      if (status && status->is_int64() && status->get_int64() / 100 == 2 && lease && lease->is_object()) {
        auto g = wire::decode_grant(lease->get_object());
        out.push_back(g ? expected<lease::Grant, Problem>(std::move(*g))
                        : expected<lease::Grant, Problem>(make_unexpected(answer_unreadable(r))));
      } else if (problem && problem->is_object() && problem->get_object().contains("code")) {
        Problem p = Problem::from_json(problem->get_object());
        if (p.status() >= 500 && !p.retry_after_s) p.retry_after_s = 1;
        out.push_back(make_unexpected(std::move(p)));
      } else {
        out.push_back(make_unexpected(answer_unreadable(r)));
      }
    }
    return out;
  }

  std::mutex m_claims_mutex;
  std::condition_variable m_claims_cv;
  std::deque<Waiting*> m_claims;
  int m_claim_senders = 0;
  std::atomic<bool> m_no_claim_batch{false};

  template <class T, class Decode>
  expected<T, Problem> call(std::string_view method, const std::string& target,
                            const std::optional<boost::json::object>& body, const std::string& key,
                            std::chrono::milliseconds timeout, Decode decode, const Extra& extra = {},
                            std::int64_t* waited_ms = nullptr) {
    Raw r = exchange(method, target, body ? json::dump(*body) : std::string(), key, timeout, extra);
    if (waited_ms) *waited_ms = r.waited_ms;
    if (r.status < 200 || r.status >= 300) return make_unexpected(problem_of(r));
    auto o = json::parse_object(r.body);
    if (!o) return make_unexpected(answer_unreadable(r));
    auto v = decode(*o);
    if (!v) return make_unexpected(answer_unreadable(r));
    return std::move(*v);
  }

  // A control plane that answered with something other than this API: treated as no
  // answer (the outcome is unknown), with what was wrong in the log's detail.
  static Problem answer_unreadable(const Raw& r) {
    Problem p(Code::unavailable,
              "the control plane's answer (status " + std::to_string(r.status) + ") is not the API's");
    p.retry_after_s = 1;
    return p;
  }

  static Problem problem_of(const Raw& r) {
    if (r.status == 0) return unreachable(r.error);
    Problem p;
    if (auto o = json::parse_object(r.body); o && o->contains("code")) {
      p = Problem::from_json(*o);
    } else {
      p = Problem(r.status >= 500 ? Code::unavailable : Code::internal,
                  "the control plane answered " + std::to_string(r.status));
    }
    if (r.retry_after)
      p.retry_after_s = r.retry_after;
    else if (p.status() >= 500 && !p.retry_after_s)
      p.retry_after_s = 1;
    return p;
  }
};

// ---- embedded -------------------------------------------------------------------------------

// The lease service in-process, called directly with a local context: no token check, no
// HTTP, no JSON (SPEC §3 single-host mode). Each call waits for its outcome.
class EmbeddedControlPlane final : public ControlPlane {
public:
  explicit EmbeddedControlPlane(const std::filesystem::path& dir)
      : m_store(std::make_unique<server::SqliteStore>("sqlite:" + (dir / "control.db").string(), true, 0,
                                                      /*serving=*/true)),
        m_service(std::make_unique<server::LeaseService>(*m_store)) {
    // The local tenant is the one of the token kept in embedded.token (made on first start,
    // mode 0600), so a database moved to a `mep server` keeps its tenant and a token for it.
    auto token_file = dir / "embedded.token";
    std::string token;
    {
      std::ifstream in(token_file);
      std::getline(in, token);
    }
    std::optional<server::AuthInfo> auth;
    if (token.rfind("mep_", 0) == 0) auth = m_store->authenticate(sha256_hex(token));
    if (!auth) {
      token = m_store->create_token("local", server::Scope::admin).second;
      mode_t old = ::umask(077); // the token file is created 0600; the process umask is restored
      {
        std::ofstream out(token_file, std::ios::trunc);
        out << token << "\n";
      }
      ::umask(old);
      ::chmod(token_file.c_str(), 0600);
      auth = m_store->authenticate(sha256_hex(token));
      if (!auth) throw std::runtime_error("the embedded control plane cannot read back its local token");
    }
    m_auth = *auth;
    m_describe = "embedded (sqlite:" + (dir / "control.db").string() + ")";
    m_sweeper = std::make_unique<server::Sweeper>(*m_store);
  }

  // The sweeper before the store it sweeps; the store (finishing its queued jobs, whose
  // completions use the service) before the service.
  ~EmbeddedControlPlane() override {
    m_sweeper.reset();
    m_service->end_waits();
    m_store.reset();
  }

  std::string describe() const override { return m_describe; }

  expected<lease::Registered, Problem> register_memory(const std::string& memory_id) override {
    lease::RegisterRequest req{memory_id};
    auto idem = key("register-" + memory_id, "/v1/memories", wire::to_json(req));
    return call<lease::Registered>([&](auto then) { m_service->register_memory(ctx(), idem, req, std::move(then)); });
  }

  expected<lease::Grant, Problem> claim(const lease::ClaimRequest& req, const std::string& key_text,
                                        const ClaimWait& wait) override {
    auto idem = key(key_text, "/v1/leases", wire::to_json(req));
    auto promise = std::make_shared<std::promise<server::ClaimAnswer>>();
    auto future = promise->get_future();
    // A waiting claim is watched as a connection would be: the wait queue polls the read
    // end of a pipe, and closing the write end is the agent going away.
    int pipe_fds[2] = {-1, -1};
    const bool waits = wait.wait.count() > 0;
    if (waits && wait.cancelled && ::pipe2(pipe_fds, O_CLOEXEC) != 0) pipe_fds[0] = pipe_fds[1] = -1;
    struct Closer {
      int* fds;
      ~Closer() {
        for (int i = 0; i < 2; ++i)
          if (fds[i] >= 0) ::close(fds[i]);
      }
    } closer{pipe_fds};
    server::WaitSpec spec{waits ? wait.wait.count() : 0, pipe_fds[0]};
    m_service->claim(ctx(), idem, req, spec, [promise](server::ClaimAnswer a) { promise->set_value(std::move(a)); });
    const auto timeout =
        waits ? std::chrono::duration_cast<std::chrono::milliseconds>(wait.wait + std::chrono::seconds(15)) : k_timeout;
    const auto limit = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto step = wait.cancelled ? std::chrono::milliseconds(100) : timeout;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(limit - std::chrono::steady_clock::now());
      if (left.count() <= 0) return make_unexpected(unreachable("the embedded control plane did not answer in time"));
      if (future.wait_for(std::min(step, left)) == std::future_status::ready) break;
      if (wait.cancelled && pipe_fds[1] >= 0 && wait.cancelled()) {
        ::close(pipe_fds[1]);
        pipe_fds[1] = -1;
        // The queue answers a client that went away at once; wait for that answer so that
        // the read end outlives the queue's watch of it.
        if (future.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
          log::warn("the embedded control plane did not end a cancelled wait");
          pipe_fds[0] = -1; // left open: the queue may still watch it
        }
        return make_unexpected(unreachable("cancelled"));
      }
    }
    server::ClaimAnswer a = future.get();
    if (!a.outcome.ok()) return make_unexpected(std::move(a.outcome.value.error()));
    lease::Grant g = std::move(*a.outcome.value);
    g.waited_ms = a.waited_ms;
    return g;
  }

  expected<lease::RenewBatchResult, Problem> renew_batch(const lease::RenewBatchRequest& req,
                                                         std::chrono::milliseconds timeout) override {
    return call<lease::RenewBatchResult>([&](auto then) { m_service->renew_batch(ctx(), req, std::move(then)); },
                                         timeout.count() > 0 ? timeout : k_timeout);
  }

  expected<void, Problem> release(const lease::LeaseRef& ref) override {
    auto r = call<server::Released>([&](auto then) { m_service->release(ctx(), ref, std::move(then)); });
    if (!r) return make_unexpected(std::move(r.error()));
    return {};
  }

  expected<lease::Branched, Problem> branch(const lease::BranchRequest& req, const std::string& key_text) override {
    auto idem = key(key_text, "/v1/memories/branch", wire::to_json(req));
    return call<lease::Branched>([&](auto then) { m_service->branch(ctx(), idem, req, std::move(then)); });
  }

  expected<lease::Memory, Problem> memory(const std::string& memory_id) override {
    return call<lease::Memory>([&](auto then) { m_service->get_memory(ctx(), memory_id, std::move(then)); });
  }

  expected<lease::Lineage, Problem> lineage(const std::string& memory_id) override {
    return call<lease::Lineage>([&](auto then) { m_service->lineage(ctx(), memory_id, std::move(then)); });
  }

  expected<lease::Verified, Problem> verify(const lease::VerifyRequest& req) override {
    return call<lease::Verified>([&](auto then) { m_service->verify(ctx(), req, std::move(then)); });
  }

  expected<lease::IdentityMapPage, Problem> identity_map(const std::optional<std::string>& cursor,
                                                         std::size_t limit) override {
    return call<lease::IdentityMapPage>(
        [&](auto then) { m_service->identity_map(ctx(), cursor, limit, std::move(then)); });
  }

private:
  static constexpr std::chrono::milliseconds k_timeout{30000};

  server::Ctx ctx() const { return server::Ctx{m_auth, uuid_v7().to_string()}; }

  // The Idempotency-Key as the HTTP edge would bind it (the same method, route and body),
  // so a key keeps its meaning for a database later served by `mep server`.
  static server::Idempotency key(const std::string& key_text, std::string_view pattern,
                                 const boost::json::object& body) {
    return server::Idempotency{key_text, server::request_fingerprint("POST", pattern, "", body)};
  }

  // Starts an operation with a completion and waits for its outcome.
  template <class T, class Start>
  expected<T, Problem> call(Start start, std::chrono::milliseconds timeout = k_timeout) {
    auto promise = std::make_shared<std::promise<server::Outcome<T>>>();
    auto future = promise->get_future();
    start(server::Then<T>([promise](server::Outcome<T> o) { promise->set_value(std::move(o)); }));
    if (future.wait_for(timeout) != std::future_status::ready)
      return make_unexpected(unreachable("the embedded control plane did not answer in time"));
    return std::move(future.get().value);
  }

  std::unique_ptr<server::Store> m_store;
  std::unique_ptr<server::LeaseService> m_service;
  std::unique_ptr<server::Sweeper> m_sweeper; // expired leases and records go, as on a server
  server::AuthInfo m_auth;
  std::string m_describe;
};

// ---- remote ---------------------------------------------------------------------------------

class RemoteControlPlane final : public HttpControlPlane {
public:
  RemoteControlPlane(std::string url, std::string token, const std::string& ca_file)
      : m_url(http::checked_base_url(std::move(url), "control-plane URL")), m_token(std::move(token)),
        m_client(ca_file) {
    if (m_token.empty()) throw std::runtime_error("a remote control plane needs a token (--token-file or MEP_TOKEN)");
  }

  std::string describe() const override { return m_url; }

protected:
  Raw exchange(std::string_view method, const std::string& target, const std::string& body,
               const std::string& idempotency_key, std::chrono::milliseconds timeout, const Extra& extra) override {
    http::ClientRequest req;
    req.method = std::string(method);
    req.url = m_url + target;
    req.headers = {{"Authorization", "Bearer " + m_token}, {"Content-Type", "application/json"}};
    if (!idempotency_key.empty()) req.headers.emplace_back("Idempotency-Key", idempotency_key);
    if (!extra.prefer.empty()) req.headers.emplace_back("Prefer", extra.prefer);
    req.cancelled = extra.cancelled;
    req.body = body;
    if (timeout.count() > 0) req.timeout = timeout;
    auto res = m_client.perform(req);
    Raw r;
    r.status = res.status;
    r.error = std::move(res.error);
    if (r.status) r.body = std::move(res.body);
    r.retry_after = res.retry_after();
    if (auto w = res.header("mep-waited-ms")) r.waited_ms = waited_header(*w);
    return r;
  }

private:
  std::string m_url;
  std::string m_token;
  http::Client m_client;
};

} // namespace

std::unique_ptr<ControlPlane> make_embedded_control_plane(const std::filesystem::path& state_dir) {
  return std::make_unique<EmbeddedControlPlane>(state_dir);
}

std::unique_ptr<ControlPlane> make_remote_control_plane(const std::string& url, const std::string& token,
                                                        const std::string& ca_file) {
  return std::make_unique<RemoteControlPlane>(url, token, ca_file);
}

} // namespace mep::daemon
