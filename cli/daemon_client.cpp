// The CLI's calls to mepd: libcurl (mep::http::Client) over the Unix socket.
#include "daemon_client.hpp"

#include "commands.hpp"
#include "mep/lease/wire.hpp"
#include "mep/time.hpp"

#include "mep/config.hpp"
#include "mep/http/client.hpp"
#include "mep/json.hpp"
#include "mep/utf8.hpp"

#include <boost/json/parse.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sys/socket.h>
#include <unistd.h>

namespace mep::cli {

std::string path_argument(const std::string& path) {
  if (!utf8::decode(path))
    throw UsageError("a path is not valid UTF-8, and mep passes paths to mepd as JSON text: rename the file");
  std::error_code ec;
  auto a = std::filesystem::absolute(path, ec);
  return ec ? path : a.string();
}

std::string resolve_socket(const std::string& flag, const std::string& config_file) {
  auto cfg = Config::load(config_file);
  std::string fallback = !xdg_runtime_dir().empty() ? (xdg_runtime_dir() / "mep" / "mepd.sock").string()
                                                    : std::string("/run/mep/mepd.sock");
  std::optional<std::string> f = flag.empty() ? std::nullopt : std::optional(flag);
  if (!cfg) throw ConfigError(cfg.error());
  return cfg->get("socket", f, "--socket", fallback).value;
}

boost::json::object DaemonReply::json() const {
  boost::system::error_code ec;
  auto v = boost::json::parse(body, ec);
  if (ec || !v.is_object()) return {};
  return std::move(v.get_object());
}

std::optional<Kind> DaemonReply::refusal() const {
  if (status == 0 || ok()) return std::nullopt;
  auto o = json();
  return o.empty() ? Kind::internal : Problem::from_json(o).kind();
}

Problem DaemonReply::problem(const std::string& socket) const {
  if (status == 0) {
    if (denied) return Problem(Code::forbidden, "cannot use mepd at " + socket + ": " + error);
    Problem p(Code::unavailable, "cannot reach mepd at " + socket + " (" + error +
                                     "): start it with 'mepd' or 'systemctl --user start mepd.socket'");
    return p;
  }
  auto o = json();
  if (o.empty()) return Problem(Code::internal, "mepd answered " + std::to_string(status));
  return Problem::from_json(o);
}

namespace {

// The CLI's connections to mepd: libcurl over the Unix socket, a new connection per request.
http::Client& curl_client() {
  static http::Client client;
  return client;
}

// Why a request got no answer, in the words the commands print after "cannot reach mepd at …".
void explain_failure(const http::ClientResponse& res, bool cancelled, DaemonReply& r) {
  if (cancelled) {
    r.error = "cancelled";
  } else if (res.os_errno == EACCES) { // a daemon that is not this user's to use
    r.denied = true;
    r.error = "permission denied: the socket belongs to another user; use your own mepd, or the system one "
              "(/run/mep/mepd.sock) as a member of the group mep";
  } else if (res.timed_out) {
    r.error = "no answer from the daemon";
  } else if (res.os_errno != 0) {
    r.error = std::strerror(res.os_errno); // refused, missing: no daemon
  } else {
    r.error = "the daemon closed the connection (" + res.error + ")";
  }
}

} // namespace

void Cancel::cancel() {
  std::lock_guard lock(m_mutex);
  m_cancelled = true;
  if (m_fd >= 0) ::shutdown(m_fd, SHUT_RDWR);
}

bool Cancel::cancelled() const {
  std::lock_guard lock(m_mutex);
  return m_cancelled;
}

bool Cancel::watch(int fd) {
  std::lock_guard lock(m_mutex);
  if (m_cancelled && fd >= 0) return false;
  m_fd = fd;
  return true;
}

namespace {
std::atomic<DaemonClient*> g_client{nullptr}; // a test's fake; null: the socket
DaemonReply socket_request(const std::string& socket, const std::string& method, const std::string& target,
                           const std::string& body, int timeout_ms, Cancel* cancel);
} // namespace

ScopedDaemonClient::ScopedDaemonClient(DaemonClient& client) {
  DaemonClient* none = nullptr;
  if (!g_client.compare_exchange_strong(none, &client))
    throw std::logic_error("a fake daemon client is in place already");
}
ScopedDaemonClient::~ScopedDaemonClient() { g_client.store(nullptr); }

DaemonReply daemon_request(const std::string& socket, const std::string& method, const std::string& target,
                           const std::string& body, int timeout_ms, Cancel* cancel) {
  if (DaemonClient* fake = g_client.load()) return fake->request(socket, method, target, body, timeout_ms, cancel);
  return socket_request(socket, method, target, body, timeout_ms, cancel);
}

namespace {
DaemonReply socket_request(const std::string& socket, const std::string& method, const std::string& target,
                           const std::string& body, int timeout_ms, Cancel* cancel) {
  DaemonReply r;
  if (cancel && cancel->cancelled()) {
    r.error = "cancelled";
    return r;
  }
  http::ClientRequest req;
  req.method = method;
  req.url = "http://mepd" + target;
  req.unix_socket = socket;
  req.body = body;
  if (!body.empty()) req.headers.emplace_back("Content-Type", "application/json");
  req.headers.emplace_back("Expect", ""); // the body goes at once: no 100-continue round (libcurl's, above 1 KiB)
  req.timeout = std::chrono::milliseconds(0);
  if (timeout_ms >= 0) req.stall = std::chrono::seconds((timeout_ms + 999) / 1000);
  if (cancel)
    req.on_socket = [cancel](int fd) {
      if (!cancel->watch(fd)) ::shutdown(fd, SHUT_RDWR); // cancelled meanwhile: ends at once
    };
  auto res = curl_client().perform(req);
  if (res.status == 0) {
    explain_failure(res, cancel && cancel->cancelled(), r);
    return r;
  }
  r.status = res.status;
  r.body = std::move(res.body);
  return r;
}
} // namespace

std::optional<std::int64_t> parse_wait(const std::string& text) {
  if (text == "inf" || text == "infinity") return k_wait_forever;
  if (text.empty() || text.size() > 12) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(text.c_str(), &end);
  if (errno || end != text.c_str() + text.size() || !(v >= 0) || v > static_cast<double>(k_wait_forever))
    return std::nullopt;
  if (!std::isdigit(static_cast<unsigned char>(text.front())) && text.front() != '.') return std::nullopt;
  return static_cast<std::int64_t>(std::ceil(v));
}

DaemonReply attach(const std::string& socket, daemon_api::AttachBody attach, std::int64_t wait_s) {
  attach.wait_s = 0;
  if (wait_s <= 0)
    return daemon_request(socket, daemon_api::target(daemon_api::Endpoint::attach),
                          json::dump(daemon_api::to_json(attach)));
  if (::isatty(STDERR_FILENO)) {
    // Ask once without waiting, to say what is waited for; then wait.
    DaemonReply first = daemon_request(socket, daemon_api::target(daemon_api::Endpoint::attach),
                                       json::dump(daemon_api::to_json(attach)));
    if (!first.held()) return first;
    const Problem held = first.problem(socket); // the refusal, read once
    std::int64_t ahead = 0;
    if (const auto* w = held.extensions.if_contains("waiters"); w && w->is_int64()) ahead = w->get_int64();
    std::string why = held.code == Code::memory_attached   ? "its memory is attached to another lease"
                      : held.code == Code::name_confusable ? "a confusable name is held by another owner"
                                                           : "held by another owner";
    if (auto holder = held_by(held); !holder.empty()) why = holder;
    std::fprintf(stderr, "waiting for %s, %s, %lld waiting ahead\n", attach.name.c_str(), why.c_str(),
                 static_cast<long long>(ahead));
  }
  attach.wait_s = wait_s;
  // The daemon answers within the wait; the socket may stay silent that long.
  const int timeout_ms = wait_s > 2'000'000 ? -1 : static_cast<int>(wait_s * 1000 + 30000);
  return daemon_request(socket, daemon_api::target(daemon_api::Endpoint::attach),
                        json::dump(daemon_api::to_json(attach)), timeout_ms);
}

bool follow_events(const std::string& socket, const std::function<bool(const std::string&)>& on_line,
                   const std::function<void(int fd)>& on_connected) {
  http::ClientRequest req;
  req.url = "http://mepd" + daemon_api::target(daemon_api::Endpoint::events).target;
  req.unix_socket = socket;
  req.timeout = std::chrono::milliseconds(0); // a stream: as long as mepd keeps it open
  int fd = -1;
  req.on_socket = [&](int s) {
    if (s < 0 && fd >= 0) on_connected(-1);
    fd = s;
  };
  bool headed = false;
  req.on_head = [&](int) { // mepd follows for this stream from here
    headed = true;
    on_connected(fd);
  };
  std::string buf;
  req.on_data = [&](std::string_view piece) {
    buf.append(piece);
    std::size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      if (!on_line(line)) return false;
    }
    return true;
  };
  auto res = curl_client().perform(req);
  return headed || res.status != 0; // a stream cut (stop()) ends in a transport error
}

std::string unreadable_answer(std::string_view what, const Problem& why) {
  return "mepd's answer to " + std::string(what) + " is not the API this mep reads (" + why.detail + ")";
}

int report_problem(const DaemonReply& r, const std::string& socket, bool json) {
  Problem p = r.problem(socket);
  if (json) {
    std::printf("%s\n", r.status ? r.body.c_str() : mep::json::dump(p.to_json()).c_str());
  } else {
    // "Invalid agent name: invalid agent name: …" reads better without the repetition.
    std::string title(p.title());
    std::string detail = p.detail;
    auto same = [](char a, char b) {
      return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
    };
    if (detail.size() > title.size() + 1 && detail[title.size()] == ':' &&
        std::equal(title.begin(), title.end(), detail.begin(), same))
      detail.erase(0, detail.find_first_not_of(' ', title.size() + 1));
    // A refusal that names its holder says who, instead of "held by another owner": one line.
    if (auto holder = held_by(p); !holder.empty()) detail = holder;
    std::fprintf(stderr, "mep: %s: %s\n", title.c_str(), detail.c_str());
  }
  return p.exit_code();
}

std::string held_by(const Problem& p) {
  const auto* v = p.extensions.if_contains("holder");
  if (!v || !v->is_object()) return {};
  auto h = lease::wire::decode_holder_view(v->get_object());
  if (!h) return {};
  std::string out = "held by " + h->display_name;
  if (!h->host.empty()) out += " on " + h->host;
  // Since when, in this host's local time: the time of day within a day, else the date too.
  const std::time_t since = static_cast<std::time_t>(h->since / 1000);
  std::tm local{};
  if (::localtime_r(&since, &local)) {
    char buf[32];
    const bool today = now_unix_ms() - h->since < 20LL * 3600 * 1000;
    std::strftime(buf, sizeof buf, today ? "%H:%M" : "%Y-%m-%d %H:%M", &local);
    out += std::string(" since ") + buf;
  }
  const long left = static_cast<long>((h->expires_at - now_unix_ms() + 999) / 1000);
  out += left > 0 ? ", expires in " + std::to_string(left) + " s" : ", expiring now";
  return out;
}

namespace {
bool label_key_ok(std::string_view k) {
  return !k.empty() && k.size() <= lease::k_max_label_key && std::all_of(k.begin(), k.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
}
} // namespace

void HolderOptions::add_to(daemon_api::AttachBody& attach) const {
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& l : labels) {
    const auto eq = l.find('=');
    if (eq == std::string::npos || !label_key_ok(std::string_view(l).substr(0, eq)))
      throw UsageError("--label must be KEY=VALUE, the key 1-63 characters of A-Z a-z 0-9 _ . - (got \"" + l + "\")");
    std::string key = l.substr(0, eq);
    if (std::any_of(pairs.begin(), pairs.end(), [&](const auto& p) { return p.first == key; }))
      throw UsageError("--label " + key + " is given twice");
    pairs.emplace_back(std::move(key), l.substr(eq + 1));
  }
  if (pairs.size() > lease::k_max_labels) throw UsageError("at most 16 --label options");
  std::sort(pairs.begin(), pairs.end());
  attach.labels = std::move(pairs);
  attach.max_hold_s = max_hold_s;
}

void add_holder_options(CLI::App* cmd, HolderOptions& o) {
  cmd->add_option("--label", o.labels,
                  "KEY=VALUE shown with the lease to operators (mep lease ls --label); repeat for more (at most 16)");
  cmd->add_option("--max-hold", o.max_hold_s,
                  "Longest the lease may be held, in seconds: renewals past it are refused and the lease is lost "
                  "(the server's --max-hold may be shorter)")
      ->check(CLI::Range(lease::k_min_hold_s, lease::k_max_hold_s));
}

std::optional<Problem> unconfirmed_release(const DaemonReply& r) {
  if (!r.ok() || r.body.empty()) return std::nullopt;
  const auto o = r.json();
  const auto* cp = o.if_contains("control_plane");
  if (!cp || !cp->is_object()) return std::nullopt;
  return Problem::from_json(cp->get_object());
}

int unconfirmed_release_status(const Problem& p) {
  // A lease the control plane no longer has (expired, revoked) is lost there: 4, as for one
  // it says expired; not "this daemon holds no lease" (1).
  return p.code == Code::lease_not_found ? exit_code::lost : p.exit_code();
}

void warn_unconfirmed_release(const std::string& name, const Problem& p) {
  std::fprintf(stderr,
               "mep: released %s on this host, but the control plane did not confirm it (%s: %s); there the name "
               "stays held until the lease expires\n",
               name.c_str(), std::string(p.title()).c_str(), p.detail.c_str());
}

} // namespace mep::cli
