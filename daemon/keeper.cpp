// mepd's lease keeper.
//
// Design notes (the daemon session machine of SPEC §4):
// * requested → claiming: attach() writes the claim intent (Idempotency-Key + body) to
//   mepd.db before sending, so a daemon that crashes mid-claim resends the same key on
//   start (resend_intents) and adopts the outcome instead of claiming twice.
// * claiming → held: a 201 stores the lease (persist) and arms the local deadline:
//   steady time when the request was *sent* + ttl − margin (10 % of ttl, at least 1 s).
// * held ⇄ degraded: renew_due() renews every lease due in one renew-batch call per tick
//   (at ttl/3 with ±10 % jitter). Leases at least half-way to their renewal ride along
//   with a due one (coalescing), so leases attached close together keep sharing one
//   round trip instead of drifting apart by their jitter; each is still renewed at
//   ≤ ttl/3. The call's timeout is half the time left to the earliest local deadline, so
//   a hung control plane yields `degraded` and a retry, with backoff, inside the
//   remaining time.
// * → lost: a 409/410/404 answer, or the local deadline passing without a successful
//   renew (mark_lost). Deadlines are enforced by their own thread (deadline_loop), never
//   behind a renewal in flight: loss is decided on the local clock, not on hearing from
//   the server. The token is no longer handed out; an event says why.
// * → released: detach(), or the bound process exiting (pid_loop, pidfd), which releases
//   within the watcher's 100 ms poll.
// Paths and file bytes stay on this host: the control plane only sees ids, names,
// tokens and owner ids (owner = <daemon id>/<attach id>).
#include "mep/keeper.hpp"

#include "mep/canonical.hpp"
#include "mep/identity.hpp"
#include "mep/json.hpp"
#include "mep/log.hpp"
#include "mep/random.hpp"
#include "mep/uuid.hpp"
#include "mep/wire.hpp"

#include <boost/json.hpp>
#include <fmt/format.h>

#include <random>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace mep::daemon {
namespace fs = std::filesystem;
using sqlite::Use;
using server::Reply;
using server::json_reply;
using server::problem_reply;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::string_view k_schema = R"sql(
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
  path TEXT PRIMARY KEY, memory_id TEXT NOT NULL, dev INTEGER NOT NULL, ino INTEGER NOT NULL,
  sha256 TEXT, updated_at INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS files_inode ON files(dev, ino);
CREATE INDEX IF NOT EXISTS files_sha ON files(sha256);
CREATE INDEX IF NOT EXISTS files_memory ON files(memory_id);
CREATE TABLE IF NOT EXISTS leases (
  canonical_name TEXT PRIMARY KEY, display_name TEXT NOT NULL, memory_id TEXT NOT NULL,
  lease_id TEXT NOT NULL, owner_client_id TEXT NOT NULL, fencing_token INTEGER NOT NULL,
  ttl_seconds INTEGER NOT NULL, expires_at INTEGER NOT NULL, path TEXT NOT NULL, bind_pid INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS registered (memory_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS intents (
  idem_key TEXT PRIMARY KEY, body TEXT NOT NULL, path TEXT NOT NULL, bind_pid INTEGER NOT NULL,
  created_at INTEGER NOT NULL);
)sql";

int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

bool pid_alive(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

Reply problem(Code c, std::string detail, const std::string& rid) {
  return problem_reply(Problem(c, std::move(detail)), rid);
}

// Passes a control-plane answer through to the local client (same status and body).
Reply relay(const CpReply& r, const std::string& rid) {
  if (r.status == 0) {
    Problem p(Code::unavailable, "the control plane is unreachable: " + r.error);
    p.retry_after_s = 1;
    return problem_reply(std::move(p), rid);
  }
  Reply out;
  out.status = r.status;
  out.body = r.body;
  out.problem = r.status >= 400;
  out.retry_after_s = r.retry_after_s;
  return out;
}

std::string str(const boost::json::object& o, std::string_view k) {
  if (auto* v = o.if_contains(k); v && v->is_string()) return std::string(v->get_string());
  return {};
}

std::int64_t num(const boost::json::object& o, std::string_view k) {
  if (auto* v = o.if_contains(k); v && v->is_int64()) return v->get_int64();
  return 0;
}

} // namespace

Keeper::Keeper(fs::path state_dir, std::unique_ptr<ControlPlane> cp)
    : m_state_dir(std::move(state_dir)), m_cp(std::move(cp)) {
  m_db = std::make_unique<sqlite::Db>((m_state_dir / "mepd.db").string(), sqlite::Mode::read_write_create);
  m_db->exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;");
  ::chmod((m_state_dir / "mepd.db").c_str(), 0600);
  m_db->exec(k_schema);
  {
    // Databases from before birth times were kept get the column; their rows have none.
    Use q(m_db->prepare("SELECT count(*) FROM pragma_table_info('files') WHERE name = 'btime'"));
    if (q->step() && q->int64(0) == 0) m_db->exec("ALTER TABLE files ADD COLUMN btime INTEGER");
  }
  {
    Use s(m_db->prepare("SELECT value FROM meta WHERE key = 'daemon_id'"));
    if (s->step()) m_daemon_id = s->text(0);
  }
  if (m_daemon_id.empty()) {
    m_daemon_id = uuid_v7().to_string();
    Use s(m_db->prepare("INSERT INTO meta(key, value) VALUES ('daemon_id', ?1)"));
    s->bind(1, m_daemon_id).run();
  }
  m_wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

Keeper::~Keeper() {
  {
    std::lock_guard lock(m_mutex);
    m_stop = true;
  }
  m_cv.notify_all();
  std::uint64_t one = 1;
  if (m_wake_fd >= 0) (void)!::write(m_wake_fd, &one, sizeof one);
  if (m_renewer.joinable()) m_renewer.join();
  if (m_deadline_watcher.joinable()) m_deadline_watcher.join();
  if (m_pid_watcher.joinable()) m_pid_watcher.join();
  for (auto& [pid, fd] : m_pidfds) ::close(fd);
  if (m_wake_fd >= 0) ::close(m_wake_fd);
}

std::chrono::milliseconds Keeper::margin(std::int64_t ttl_s) const {
  return std::chrono::milliseconds(std::max<std::int64_t>(1000, ttl_s * 100));
}

// A lease the control plane granted (the claim's 201 body), held from `sent` on: the
// local deadline is sent + ttl − margin, the first renewal at ttl/3.
Held Keeper::held_from_grant(const boost::json::object& o, std::string owner, std::string path, pid_t pid,
                             SteadyTime sent) const {
  Held h;
  h.canonical_name = str(o, "canonical_name");
  h.display_name = str(o, "display_name");
  h.memory_id = str(o, "memory_instance_id");
  h.lease_id = str(o, "lease_id");
  h.fencing_token = num(o, "fencing_token");
  h.ttl_s = num(o, "ttl_seconds");
  h.expires_at = parse_rfc3339(str(o, "expires_at")).value_or(0);
  h.owner_client_id = std::move(owner);
  h.path = std::move(path);
  h.bind_pid = pid;
  h.state = "held";
  h.local_deadline = sent + std::chrono::seconds(h.ttl_s) - margin(h.ttl_s);
  h.next_renew = sent + std::chrono::milliseconds(h.ttl_s * 1000 / 3);
  return h;
}

// ---- start-up: re-adoption and intents ---------------------------------------------------

void Keeper::start() {
  std::vector<pid_t> dead;
  {
    std::lock_guard lock(m_mutex);
    Use s(m_db->prepare("SELECT canonical_name, display_name, memory_id, lease_id, owner_client_id, "
                        "fencing_token, ttl_seconds, expires_at, path, bind_pid FROM leases"));
    UnixMs wall = now_unix_ms();
    auto steady = Clock::now();
    std::vector<std::string> expired;
    while (s->step()) {
      Held h;
      h.canonical_name = s->text(0);
      h.display_name = s->text(1);
      h.memory_id = s->text(2);
      h.lease_id = s->text(3);
      h.owner_client_id = s->text(4);
      h.fencing_token = s->int64(5);
      h.ttl_s = s->int64(6);
      h.expires_at = s->int64(7);
      h.path = s->text(8);
      h.bind_pid = static_cast<pid_t>(s->int64(9));
      auto left = std::chrono::milliseconds(h.expires_at - wall);
      if (left <= margin(h.ttl_s)) {
        expired.push_back(h.canonical_name);
        continue;
      }
      h.state = "held";
      h.local_deadline = steady + left - margin(h.ttl_s);
      h.next_renew = steady; // renew at once: proves the stored token is still current
      m_leases.emplace(h.canonical_name, h);
      note_times(h);
      log::info("re-adopted lease {} (token {})", h.canonical_name, h.fencing_token);
    }
    s->reset();
    for (const auto& n : expired) forget(n);
    for (auto& [name, h] : m_leases) {
      if (h.bind_pid && !pid_alive(h.bind_pid)) dead.push_back(h.bind_pid);
      else if (h.bind_pid) watch_pid(h.bind_pid);
    }
  }
  // Leases whose process died while the daemon was down are released now.
  for (pid_t pid : dead) {
    std::vector<Held> gone;
    {
      std::lock_guard lock(m_mutex);
      for (auto it = m_leases.begin(); it != m_leases.end();)
        if (it->second.bind_pid == pid) {
          gone.push_back(it->second);
          forget(it->first);
          it = m_leases.erase(it);
        } else {
          ++it;
        }
    }
    for (auto& h : gone) release_on_server(h);
  }
  pull_identity_map();
  resend_intents();
  m_renewer = std::thread([this] { renew_loop(); });
  m_deadline_watcher = std::thread([this] { deadline_loop(); });
  m_pid_watcher = std::thread([this] { pid_loop(); });
}

// SPEC §10: after a legacy migration the control plane publishes legacy memory
// references → memory ids. A reference that names a file on this host (an absolute path)
// gets that identity in the path map and the xattr; the path itself never leaves the host.
void Keeper::pull_identity_map() {
  std::optional<std::string> cursor;
  std::size_t adopted = 0;
  for (int page = 0; page < 10000; ++page) {
    std::string target = "/v1/migration/identity-map?limit=1000";
    if (cursor) {
      static constexpr char hex[] = "0123456789ABCDEF";
      target += "&cursor=";
      for (unsigned char ch : *cursor) {
        if (std::isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~') target.push_back(static_cast<char>(ch));
        else target += {'%', hex[ch >> 4], hex[ch & 0xF]};
      }
    }
    CpReply r = m_cp->request("GET", target, "");
    if (!r.ok()) {
      if (r.status == 0) log::warn("identity map not pulled: the control plane is unreachable");
      return;
    }
    auto o = r.json();
    auto* entries = o.if_contains("entries");
    if (!entries || !entries->is_array()) return;
    std::lock_guard lock(m_mutex);
    for (const auto& e : entries->get_array()) {
      if (!e.is_object()) continue;
      std::string ref = str(e.get_object(), "legacy_memory_ref");
      std::string id = str(e.get_object(), "memory_instance_id");
      if (ref.empty() || ref.front() != '/' || !Uuid::parse(id)) continue;
      auto st = stat_file(ref);
      if (!st || !st->regular) continue;
      write_id_xattr(ref, id);
      remember_file(id, ref, true);
      ++adopted;
    }
    auto* next = o.if_contains("next_cursor");
    if (!next || !next->is_string()) break;
    cursor = std::string(next->get_string());
  }
  if (adopted) log::info("identity map: {} legacy memory files on this host now carry their memory id", adopted);
}

void Keeper::resend_intents() {
  struct Intent {
    std::string key, body, path;
    pid_t pid;
  };
  std::vector<Intent> intents;
  {
    std::lock_guard lock(m_mutex);
    Use s(m_db->prepare("SELECT idem_key, body, path, bind_pid FROM intents"));
    while (s->step()) intents.push_back({s->text(0), s->text(1), s->text(2), static_cast<pid_t>(s->int64(3))});
  }
  for (const auto& in : intents) {
    auto sent = Clock::now();
    CpReply r = m_cp->request("POST", "/v1/leases", in.body, in.key);
    if (r.status == 0 || r.status >= 500 || r.code() == "idempotency-request-in-flight")
      continue; // still unknown: try again later
    std::lock_guard lock(m_mutex);
    {
      Use d(m_db->prepare("DELETE FROM intents WHERE idem_key = ?1"));
      d->bind(1, in.key).run();
    }
    if (r.status != 201 && r.status != 200) continue;
    auto body = json::parse_object(in.body);
    Held h = held_from_grant(r.json(), body ? str(*body, "owner_client_id") : std::string(), in.path, in.pid, sent);
    if (h.bind_pid && !pid_alive(h.bind_pid)) {
      // The agent that asked is gone; the claim it made must not linger.
      log::info("releasing lease {} adopted from an intent whose agent exited", h.canonical_name);
      release_on_server(h);
      continue;
    }
    persist(h);
    if (h.bind_pid) watch_pid(h.bind_pid);
    m_leases[h.canonical_name] = h;
    note_times(h);
    emit("granted", h);
    log::info("adopted lease {} from a pending claim intent", h.canonical_name);
  }
}

// ---- identity -------------------------------------------------------------------------------

void Keeper::remember_file(const std::string& memory_id, const fs::path& path, bool with_hash) {
  auto st = stat_file(path);
  if (!st) return;
  std::optional<std::string> sha;
  if (with_hash && st->size > 0) sha = file_sha256(path);
  Use s(m_db->prepare("INSERT INTO files(path, memory_id, dev, ino, sha256, updated_at, btime) "
                      "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) "
                      "ON CONFLICT(path) DO UPDATE SET memory_id = ?2, dev = ?3, ino = ?4, "
                      "sha256 = coalesce(?5, CASE WHEN files.memory_id = ?2 THEN files.sha256 END), updated_at = ?6, "
                      "btime = ?7"));
  s->bind(1, path.string()).bind(2, memory_id).bind(3, static_cast<std::int64_t>(st->dev))
      .bind(4, static_cast<std::int64_t>(st->ino)).bind(5, sha).bind(6, now_unix_ms()).bind(7, st->birth_ns).run();
}

// Memory ids this daemon registered with (or had confirmed by) its control plane.
bool Keeper::knows_memory(const std::string& memory_id) {
  Use s(m_db->prepare("SELECT 1 FROM registered WHERE memory_id = ?1"));
  s->bind(1, memory_id);
  return s->step();
}

// POST /v1/memories with a client-minted id; the problem when it is not registered.
// The caller holds m_mutex (the id is recorded in the daemon's database).
std::optional<Problem> Keeper::register_memory(const std::string& memory_id) {
  m_cp_requests++;
  CpReply r = m_cp->request("POST", "/v1/memories", json::dump(boost::json::object{{"memory_instance_id", memory_id}}),
                            "register-" + memory_id);
  if (r.ok()) {
    Use s(m_db->prepare("INSERT OR IGNORE INTO registered(memory_id) VALUES (?1)"));
    s->bind(1, memory_id).run();
    return std::nullopt;
  }
  Problem p = r.status ? Problem::from_json(r.json()) : Problem(Code::unavailable, "the control plane is unreachable");
  if (!r.status) p.retry_after_s = 1;
  return p;
}

// Resolution order (SPEC §7): xattr, then (device, inode), then a unique content match.
// An inode number names the file it was recorded for only while that file exists: a file
// created later at the same number (the first one deleted) has another birth time, and is
// not that memory. Where the filesystem keeps no birth time, the inode number alone counts.
// Unknown files get a fresh UUIDv7 registered with the control plane when asked to.
expected<Keeper::Identity, Problem> Keeper::resolve(const fs::path& path, bool register_unknown) {
  auto st = stat_file(path);
  if (!st || !st->regular)
    return make_unexpected(Problem(Code::invalid_request, "no such regular file: create it with 'mep init PATH'"));
  std::optional<std::string> id = read_id_xattr(path);
  if (!id) {
    Use s(m_db->prepare("SELECT memory_id FROM files WHERE dev = ?1 AND ino = ?2 "
                        "AND (btime IS NULL OR ?3 IS NULL OR btime = ?3) LIMIT 1"));
    s->bind(1, static_cast<std::int64_t>(st->dev)).bind(2, static_cast<std::int64_t>(st->ino)).bind(3, st->birth_ns);
    if (s->step()) id = s->text(0);
  }
  bool hashed = false;
  if (!id && st->size > 0) {
    if (auto sha = file_sha256(path)) {
      hashed = true;
      Use s(m_db->prepare("SELECT DISTINCT memory_id FROM files WHERE sha256 = ?1 LIMIT 2"));
      s->bind(1, *sha);
      std::vector<std::string> found;
      while (s->step()) found.push_back(s->text(0));
      if (found.size() == 1) id = found.front();
    }
  }
  if (id && register_unknown && !knows_memory(*id)) {
    // An id this daemon has not registered, from the file's attribute (a copy made with
    // `cp -a` or `rsync -X` on another host) or its maps: the control plane may not know
    // it. Registering is idempotent for the tenant that has it (200) and refused when
    // another tenant does (409 memory-id-taken); it happens once per id.
    if (auto p = register_memory(*id); p) return make_unexpected(std::move(*p));
  }
  if (id) {
    write_id_xattr(path, *id);
    remember_file(*id, path, hashed);
    return Identity{*id, false};
  }
  if (!register_unknown)
    return make_unexpected(Problem(Code::memory_not_found,
                                   "this file has no memory identity yet (attach it, or create one with mep init)"));
  std::string fresh = uuid_v7().to_string();
  if (auto p = register_memory(fresh); p) return make_unexpected(std::move(*p));
  write_id_xattr(path, fresh);
  remember_file(fresh, path, true);
  return Identity{fresh, true};
}

// ---- attach / detach --------------------------------------------------------------------------

boost::json::object Keeper::lease_json(const Held& h) const {
  boost::json::object o{{"lease_id", h.lease_id},
                        {"canonical_name", h.canonical_name},
                        {"display_name", h.display_name},
                        {"memory_instance_id", h.memory_id}};
  if (h.state != "lost") o["fencing_token"] = h.fencing_token;
  o["expires_at"] = format_rfc3339_ms(h.expires_at);
  o["ttl_seconds"] = h.ttl_s;
  o["path"] = h.path;
  o["state"] = h.state;
  o["bind_pid"] = h.bind_pid ? boost::json::value(h.bind_pid) : boost::json::value(nullptr);
  if (!h.lost_reason.empty()) o["lost_reason"] = h.lost_reason;
  return o;
}

void Keeper::persist(const Held& h) {
  Use s(m_db->prepare("INSERT OR REPLACE INTO leases(canonical_name, display_name, memory_id, lease_id, "
                      "owner_client_id, fencing_token, ttl_seconds, expires_at, path, bind_pid) "
                      "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"));
  s->bind(1, h.canonical_name).bind(2, h.display_name).bind(3, h.memory_id).bind(4, h.lease_id)
      .bind(5, h.owner_client_id).bind(6, h.fencing_token).bind(7, h.ttl_s).bind(8, h.expires_at)
      .bind(9, h.path).bind(10, static_cast<std::int64_t>(h.bind_pid)).run();
}

void Keeper::forget(const std::string& canonical_name) {
  Use s(m_db->prepare("DELETE FROM leases WHERE canonical_name = ?1"));
  s->bind(1, canonical_name).run();
}

void Keeper::emit(std::string_view event, const Held& h, std::string_view code) {
  if (m_sinks.empty()) return;
  boost::json::object o{{"event", event},
                        {"canonical_name", h.canonical_name},
                        {"memory_instance_id", h.memory_id},
                        {"state", h.state},
                        {"at", format_rfc3339_ms(now_unix_ms())}};
  if (event != "lost" && event != "released") {
    o["fencing_token"] = h.fencing_token;
    o["expires_at"] = format_rfc3339_ms(h.expires_at);
  }
  if (!code.empty()) o["reason"] = code;
  std::string line = json::dump(o) + "\n";
  for (auto& [id, sink] : m_sinks) sink(line);
}

void Keeper::mark_lost(Held& h, std::string_view reason) {
  if (h.state == "lost") return;
  h.state = "lost";
  h.lost_reason = reason;
  ++m_lost;
  forget(h.canonical_name);
  log::warn("lease {} lost: {}", h.canonical_name, reason);
  emit("lost", h, reason);
}

server::Reply Keeper::attach(const AttachRequest& req, const std::string& rid) {
  // Validate locally first: the same canonicalizer and bounds as the server.
  auto name = canonicalize(req.name);
  if (!name) return problem_reply(name.error().to_problem(), rid);
  if (req.ttl_s < server::k_min_ttl_s || req.ttl_s > server::k_max_ttl_s)
    return problem(Code::invalid_ttl, fmt::format("ttl_seconds must be between {} and {}", server::k_min_ttl_s,
                                                  server::k_max_ttl_s), rid);
  std::string attach_id = uuid_v7().to_string();
  std::string key = "claim-" + attach_id;
  std::string body;
  std::string path = req.path.string();
  {
    std::lock_guard lock(m_mutex);
    auto it = m_leases.find(name->canonical_name);
    if (it != m_leases.end() && it->second.state == "lost") {
      m_leases.erase(it); // a lost lease is only a record; a new attach replaces it
    }
    auto ident = resolve(req.path, true);
    if (!ident) return problem_reply(std::move(ident.error()), rid);
    body = json::dump(boost::json::object{{"display_name", req.name},
                                          {"memory_instance_id", ident->memory_id},
                                          {"owner_client_id", m_daemon_id + "/" + attach_id},
                                          {"ttl_seconds", req.ttl_s}});
    // Exactly once: the intent is on disk before the claim leaves.
    Use s(m_db->prepare("INSERT INTO intents(idem_key, body, path, bind_pid, created_at) VALUES (?1, ?2, ?3, ?4, ?5)"));
    s->bind(1, key).bind(2, body).bind(3, path).bind(4, static_cast<std::int64_t>(req.bind_pid ? req.pid : 0))
        .bind(5, now_unix_ms()).run();
  }
  CpReply r;
  SteadyTime sent;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(150 * attempt));
    sent = Clock::now();
    m_cp_requests++;
    r = m_cp->request("POST", "/v1/leases", body, key);
    if (r.status != 0 && r.status < 500 && r.code() != "idempotency-request-in-flight") break;
  }
  std::lock_guard lock(m_mutex);
  if (r.status == 0 || r.status >= 500 || r.code() == "idempotency-request-in-flight") {
    // Unknown outcome: the intent stays; the renewal loop resends it and releases any
    // lease it turns out to have won, since this caller was told it failed.
    Use s(m_db->prepare("UPDATE intents SET bind_pid = -1 WHERE idem_key = ?1"));
    s->bind(1, key).run();
    return relay(r, rid);
  }
  {
    Use d(m_db->prepare("DELETE FROM intents WHERE idem_key = ?1"));
    d->bind(1, key).run();
  }
  if (r.status != 201 && r.status != 200) return relay(r, rid);
  Held h = held_from_grant(r.json(), m_daemon_id + "/" + attach_id, path, req.bind_pid ? req.pid : 0, sent);
  persist(h);
  m_leases[h.canonical_name] = h;
  note_times(h);
  ++m_grants;
  if (h.bind_pid) watch_pid(h.bind_pid);
  emit("granted", h);
  return json_reply(201, lease_json(h));
}

void Keeper::release_on_server(const Held& h) {
  m_cp_requests++;
  std::string body = json::dump(boost::json::object{{"canonical_name", h.canonical_name},
                                                     {"memory_instance_id", h.memory_id},
                                                     {"fencing_token", h.fencing_token},
                                                     {"owner_client_id", h.owner_client_id}});
  CpReply r = m_cp->request("POST", "/v1/leases/release", body);
  if (r.status == 0 || r.status >= 500)
    log::warn("release of {} did not reach the control plane ({}); it expires with its TTL", h.canonical_name,
              r.status ? std::to_string(r.status) : r.error);
}

server::Reply Keeper::detach(const std::string& display, const std::string& rid) {
  auto name = canonicalize(display);
  std::string key = name ? name->canonical_name : display;
  Held h;
  {
    std::lock_guard lock(m_mutex);
    auto it = m_leases.find(key);
    if (it == m_leases.end()) return problem(Code::lease_not_found, "this daemon holds no lease under that name", rid);
    h = it->second;
    m_leases.erase(it);
    forget(key);
    // The fingerprint is refreshed at release, so a copy made later is recognized.
    remember_file(h.memory_id, h.path, true);
  }
  if (h.state != "lost") release_on_server(h);
  h.state = "released";
  std::lock_guard lock(m_mutex);
  emit("released", h);
  return server::no_content();
}

server::Reply Keeper::list(const std::string&) {
  std::lock_guard lock(m_mutex);
  boost::json::array arr;
  for (const auto& [name, h] : m_leases) arr.emplace_back(lease_json(h));
  return json_reply(200, boost::json::object{{"leases", std::move(arr)}});
}

server::Reply Keeper::get(const std::string& display, const std::string& rid) {
  auto name = canonicalize(display);
  std::lock_guard lock(m_mutex);
  auto it = m_leases.find(name ? name->canonical_name : display);
  if (it == m_leases.end()) return problem(Code::lease_not_found, "this daemon holds no lease under that name", rid);
  return json_reply(200, lease_json(it->second));
}

// ---- branch, identify, init --------------------------------------------------------------------

server::Reply Keeper::branch(const fs::path& path, const fs::path& new_path, const std::string& rid) {
  std::string parent;
  std::int64_t token = 0;
  {
    std::lock_guard lock(m_mutex);
    auto ident = resolve(path, false);
    if (!ident) return problem_reply(std::move(ident.error()), rid);
    parent = ident->memory_id;
    bool lost = false;
    for (const auto& [n, h] : m_leases) {
      if (h.memory_id != parent) continue;
      if (h.state == "lost") lost = true;
      else token = h.fencing_token;
    }
    if (!token && lost)
      return problem(Code::lease_expired, "the lease on the source was lost: attach it again to branch", rid);
    if (!token)
      return problem(Code::lease_not_found, "branching needs a live lease on the source: attach it first", rid);
  }
  std::error_code ec;
  if (fs::exists(new_path, ec)) return problem(Code::invalid_request, "the new path already exists", rid);
  if (!fs::copy_file(path, new_path, fs::copy_options::none, ec))
    return problem(Code::invalid_request, "cannot copy the memory file: " + ec.message(), rid);
  std::string id = uuid_v7().to_string();
  m_cp_requests++;
  CpReply r = m_cp->request("POST", "/v1/memories/branch",
                            json::dump(boost::json::object{{"parent_memory_instance_id", parent},
                                                           {"parent_fencing_token", token},
                                                           {"memory_instance_id", id}}),
                            "branch-" + id);
  if (!r.ok()) {
    fs::remove(new_path, ec);
    return relay(r, rid);
  }
  write_id_xattr(new_path, id);
  {
    std::lock_guard lock(m_mutex);
    remember_file(id, new_path, false); // same bytes as the parent: no fingerprint, no ambiguity
  }
  auto o = r.json();
  o["path"] = new_path.string();
  return json_reply(201, o);
}

server::Reply Keeper::identify(const fs::path& path, const std::string& rid) {
  std::string id;
  {
    std::lock_guard lock(m_mutex);
    auto ident = resolve(path, false);
    if (!ident) return problem_reply(std::move(ident.error()), rid);
    id = ident->memory_id;
  }
  m_cp_requests++;
  CpReply r = m_cp->request("GET", "/v1/memories/" + id, "");
  boost::json::object o{{"memory_instance_id", id}, {"path", path.string()}};
  if (r.ok()) {
    auto m = r.json();
    o["parent_memory_instance_id"] = m.contains("parent_memory_instance_id") ? m["parent_memory_instance_id"] : nullptr;
    o["branched_at_token"] = m.contains("branched_at_token") ? m["branched_at_token"] : nullptr;
  } else {
    o["parent_memory_instance_id"] = nullptr;
  }
  return json_reply(200, o);
}

server::Reply Keeper::init(const fs::path& path, mode_t mode, const std::string& rid) {
  int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0)
    return problem(Code::invalid_request,
                   errno == EEXIST ? "the file already exists" : std::string("cannot create the file: ") + std::strerror(errno),
                   rid);
  ::fchmod(fd, mode); // the client's umask, not the daemon's
  ::close(fd);
  std::string id = uuid_v7().to_string();
  std::lock_guard lock(m_mutex);
  if (auto p = register_memory(id); p) {
    ::unlink(path.c_str());
    return problem_reply(std::move(*p), rid);
  }
  write_id_xattr(path, id);
  remember_file(id, path, false);
  return json_reply(201, boost::json::object{{"memory_instance_id", id}, {"path", path.string()}});
}

server::Reply Keeper::lineage(const std::optional<fs::path>& path, const std::string& given_id, const std::string& rid) {
  std::string id = given_id;
  if (path) {
    std::lock_guard lock(m_mutex);
    auto ident = resolve(*path, false);
    if (!ident) return problem_reply(std::move(ident.error()), rid);
    id = ident->memory_id;
  } else if (!Uuid::parse(id)) {
    return problem(Code::invalid_request, "id must be a memory id (UUID)", rid);
  }
  m_cp_requests++;
  return relay(m_cp->request("GET", "/v1/memories/" + Uuid::parse(id)->to_string() + "/lineage", ""), rid);
}

// ---- renewals -------------------------------------------------------------------------------------

void Keeper::renew_loop() {
  auto last_intents = Clock::now();
  std::unique_lock lock(m_mutex);
  while (!m_stop) {
    m_cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return m_stop; });
    if (m_stop) break;
    lock.unlock();
    renew_due();
    if (Clock::now() - last_intents > std::chrono::seconds(2)) {
      resend_intents();
      last_intents = Clock::now();
    }
    lock.lock();
  }
}

void Keeper::renew_due() {
  struct Due {
    std::string name;
    std::int64_t token;
    std::int64_t ttl_s;
  };
  std::vector<Due> due;
  std::string items; // the JSON array's members, built as text (no DOM per lease)
  std::chrono::milliseconds timeout{};
  {
    std::lock_guard lock(m_mutex);
    auto now = Clock::now();
    if (now < m_next_renew_check) return; // nothing can be due yet: no scan of every lease
    bool any_due = false;
    auto earliest = SteadyTime::max();
    for (auto& [name, h] : m_leases) {
      if (h.state == "lost") continue;
      if (now >= h.local_deadline) {
        mark_lost(h, "deadline");
        continue;
      }
      earliest = std::min(earliest, h.local_deadline);
      any_due = any_due || now >= h.next_renew;
    }
    if (!any_due) {
      recompute_checks();
      return;
    }
    auto add = [&](const Held& h) {
      due.push_back({h.canonical_name, h.fencing_token, h.ttl_s});
      if (!items.empty()) items.push_back(',');
      items += "{\"canonical_name\":";
      json::append_string(items, h.canonical_name);
      items += ",\"memory_instance_id\":";
      json::append_string(items, h.memory_id);
      items += ",\"fencing_token\":" + std::to_string(h.fencing_token) + ",\"owner_client_id\":";
      json::append_string(items, h.owner_client_id);
      items += ",\"ttl_seconds\":" + std::to_string(h.ttl_s) + "}";
    };
    // Due leases first, then those due within the coming second (at most ttl/6 early):
    // a daemon with many leases makes about one call a second, each lease renewed close
    // to ttl/3, and a few leases still share calls instead of one call each.
    for (auto& [name, h] : m_leases)
      if (h.state != "lost" && now >= h.next_renew && due.size() < server::k_max_batch) add(h);
    for (auto& [name, h] : m_leases) {
      if (h.state == "lost" || now >= h.next_renew || due.size() >= server::k_max_batch) continue;
      auto lookahead = std::min<Clock::duration>(std::chrono::seconds(1), std::chrono::milliseconds(h.ttl_s * 1000 / 6));
      if (now >= h.next_renew - lookahead) add(h);
    }
    timeout = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(earliest - now) / 2,
                         std::chrono::milliseconds(250), std::chrono::milliseconds(10000));
  }
  auto sent = Clock::now();
  std::string body = "{\"owner_client_id\":";
  json::append_string(body, m_daemon_id);
  body += ",\"leases\":[" + items + "]}";
  CpReply r = m_cp->request("POST", "/v1/leases/renew-batch", body, {}, timeout);
  std::lock_guard lock(m_mutex);
  m_cp_requests++;
  m_batches++;
  m_batch_leases += static_cast<long>(due.size());
  boost::json::array results;
  if (r.ok()) {
    auto o = r.json();
    if (auto* v = o.if_contains("results"); v && v->is_array()) results = v->get_array();
  }
  // One transaction (one fsync) for the whole batch's bookkeeping, not one per lease.
  m_db->exec("BEGIN");
  struct Commit {
    sqlite::Db& db;
    ~Commit() {
      try {
        db.exec("COMMIT");
      } catch (const std::exception& e) {
        log::error("cannot persist renewals: {}", e.what());
        try {
          db.exec("ROLLBACK");
        } catch (...) {
        }
      }
    }
  } commit{*m_db};
  for (std::size_t i = 0; i < due.size(); ++i) {
    auto it = m_leases.find(due[i].name);
    if (it == m_leases.end() || it->second.fencing_token != due[i].token || it->second.state == "lost") continue;
    Held& h = it->second;
    const boost::json::object* item = i < results.size() && results[i].is_object() ? &results[i].get_object() : nullptr;
    std::int64_t status = item ? num(*item, "status") : 0;
    if (status == 200) {
      h.expires_at = parse_rfc3339(str(*item, "expires_at")).value_or(h.expires_at);
      h.local_deadline = sent + std::chrono::seconds(h.ttl_s) - margin(h.ttl_s);
      // ±10 % jitter spreads renewals; it needs no cryptographic randomness.
      static thread_local std::minstd_rand jitter_rng{std::random_device{}()};
      double factor = 0.9 + 0.2 * static_cast<double>(jitter_rng() % 1000) / 1000.0;
      h.next_renew = sent + std::chrono::milliseconds(static_cast<std::int64_t>(h.ttl_s * 1000 / 3 * factor));
      h.state = "held";
      h.failures = 0;
      Use u(m_db->prepare("UPDATE leases SET expires_at = ?1 WHERE canonical_name = ?2"));
      u->bind(1, h.expires_at).bind(2, h.canonical_name).run();
      emit("renewed", h);
    } else if (status == 409 || status == 410 || status == 404) {
      mark_lost(h, item ? str(*item, "code") : "lost");
    } else {
      // No definite answer: degraded, retry with backoff inside the remaining time.
      ++h.failures;
      if (h.state != "degraded") {
        h.state = "degraded";
        emit("degraded", h, r.status ? std::to_string(r.status) : "unreachable");
      }
      auto left = h.local_deadline - Clock::now();
      auto backoff = std::min<Clock::duration>(std::chrono::milliseconds(250 << std::min(h.failures, 5)), left / 4);
      h.next_renew = Clock::now() + std::max<Clock::duration>(backoff, std::chrono::milliseconds(100));
    }
  }
  recompute_checks();
}

void Keeper::note_times(const Held& h) {
  m_next_renew_check = std::min(m_next_renew_check, h.next_renew);
  m_next_deadline_check = std::min(m_next_deadline_check, h.local_deadline);
}

// One pass over the leases: when the next renewal and the next deadline fall due. The
// renewer and the deadline thread sleep through the time before, instead of scanning
// every lease on every tick (10,000 leases would cost a few % of a core).
void Keeper::recompute_checks() {
  m_next_renew_check = SteadyTime::max();
  m_next_deadline_check = SteadyTime::max();
  for (const auto& [name, h] : m_leases)
    if (h.state != "lost") note_times(h);
}

// Marks leases lost when their local deadline passes, independently of renewals in flight.
void Keeper::deadline_loop() {
  std::unique_lock lock(m_mutex);
  while (!m_stop) {
    m_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return m_stop; });
    if (m_stop) break;
    auto now = Clock::now();
    if (now < m_next_deadline_check) continue;
    for (auto& [name, h] : m_leases)
      if (h.state != "lost" && now >= h.local_deadline) mark_lost(h, "deadline");
    recompute_checks();
  }
}

// ---- pid watches ----------------------------------------------------------------------------------------

void Keeper::watch_pid(pid_t pid) {
  if (m_pidfds.count(pid)) return;
  int fd = pidfd_open(pid);
  if (fd < 0) {
    // Already gone: the watcher releases it on its next pass.
    fd = -1;
  }
  m_pidfds[pid] = fd;
  std::uint64_t one = 1;
  (void)!::write(m_wake_fd, &one, sizeof one);
}

void Keeper::pid_loop() {
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<pid_t> pids;
    std::vector<pid_t> gone;
    {
      std::lock_guard lock(m_mutex);
      if (m_stop) return;
      fds.push_back({m_wake_fd, POLLIN, 0});
      pids.push_back(0);
      for (auto& [pid, fd] : m_pidfds) {
        if (fd < 0) {
          gone.push_back(pid);
          continue;
        }
        fds.push_back({fd, POLLIN, 0});
        pids.push_back(pid);
      }
    }
    if (gone.empty()) {
      ::poll(fds.data(), fds.size(), 200);
      if (fds[0].revents & POLLIN) {
        std::uint64_t v;
        (void)!::read(m_wake_fd, &v, sizeof v);
      }
      for (std::size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) gone.push_back(pids[i]);
    }
    if (gone.empty()) continue;
    std::vector<Held> released;
    {
      std::lock_guard lock(m_mutex);
      for (pid_t pid : gone) {
        auto it = m_pidfds.find(pid);
        if (it != m_pidfds.end()) {
          if (it->second >= 0) ::close(it->second);
          m_pidfds.erase(it);
        }
        for (auto l = m_leases.begin(); l != m_leases.end();) {
          if (l->second.bind_pid == pid) {
            released.push_back(l->second);
            forget(l->first);
            remember_file(l->second.memory_id, l->second.path, true);
            l = m_leases.erase(l);
          } else {
            ++l;
          }
        }
      }
    }
    for (auto& h : released) {
      if (h.state != "lost") release_on_server(h);
      log::info("agent process exited; released {}", h.canonical_name);
      h.state = "released";
      std::lock_guard lock(m_mutex);
      emit("released", h);
    }
  }
}

// ---- events, health, metrics -------------------------------------------------------------------------

int Keeper::subscribe(std::function<void(const std::string&)> sink) {
  std::lock_guard lock(m_mutex);
  int id = m_next_sink++;
  m_sinks[id] = std::move(sink);
  return id;
}

void Keeper::unsubscribe(int id) {
  std::lock_guard lock(m_mutex);
  m_sinks.erase(id);
}

boost::json::object Keeper::health() {
  std::lock_guard lock(m_mutex);
  return boost::json::object{{"status", "ok"},
                             {"daemon_id", m_daemon_id},
                             {"control_plane", m_cp->describe()},
                             {"leases", static_cast<std::int64_t>(m_leases.size())}};
}

std::string Keeper::metrics() {
  std::lock_guard lock(m_mutex);
  long held = 0, degraded = 0, lost = 0;
  for (const auto& [n, h] : m_leases) {
    if (h.state == "held") ++held;
    else if (h.state == "degraded") ++degraded;
    else if (h.state == "lost") ++lost;
  }
  return fmt::format(
      "# HELP mepd_leases Leases this daemon keeps, by state\n# TYPE mepd_leases gauge\n"
      "mepd_leases{{state=\"held\"}} {}\nmepd_leases{{state=\"degraded\"}} {}\nmepd_leases{{state=\"lost\"}} {}\n"
      "# HELP mepd_grants_total Leases granted through this daemon\n# TYPE mepd_grants_total counter\nmepd_grants_total {}\n"
      "# HELP mepd_leases_lost_total Leases lost\n# TYPE mepd_leases_lost_total counter\nmepd_leases_lost_total {}\n"
      "# HELP mepd_renew_batches_total renew-batch calls\n# TYPE mepd_renew_batches_total counter\nmepd_renew_batches_total {}\n"
      "# HELP mepd_renewed_leases_total Leases sent in renew-batch calls\n# TYPE mepd_renewed_leases_total counter\n"
      "mepd_renewed_leases_total {}\n"
      "# HELP mepd_control_plane_requests_total Requests sent to the control plane\n"
      "# TYPE mepd_control_plane_requests_total counter\nmepd_control_plane_requests_total {}\n",
      held, degraded, lost, m_grants, m_lost, m_batches, m_batch_leases, m_cp_requests);
}

} // namespace mep::daemon
