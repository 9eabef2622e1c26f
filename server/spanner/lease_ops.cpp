// The Spanner store's lease operations: each one read-write transaction of two calls — one
// statement that begins it and reads what the rules need (Spanner's clock included), and a
// commit of the mutations the rules decided (lease_rules.hpp), audit rows and the
// Idempotency-Key's record with them.
#include "mep/spanner/store.hpp"

#include "mep/canonical.hpp"
#include "mep/lease_rules.hpp"
#include "mep/log.hpp"
#include "mep/metrics.hpp"
#include "mep/uuid.hpp"
#include "rows.hpp"

#include <boost/json/array.hpp>
#include <fmt/format.h>

#include <algorithm>

namespace mep::server::spanner {
namespace json = boost::json;

// ---- rows ----------------------------------------------------------------------------------------

LeaseRow lease_of(const Row& r) {
  LeaseRow l;
  l.memory_id = r.str(1);
  l.lease_id = r.str(2);
  l.tenant_id = r.str(3);
  l.canonical_name = r.str(4);
  l.display_name = r.str(5);
  l.skeleton = r.str(6);
  l.fencing_token = r.int64(7);
  l.owner_client_id = r.str(8);
  l.ttl_s = r.int64(9);
  l.expires_at = r.int64(10);
  l.acquired_at = r.int64(11);
  l.holder = r.opt_str(12).value_or("");
  l.granted_at = r.opt_int64(13).value_or(l.acquired_at);
  l.renewed_at = r.opt_int64(14);
  l.renewals = r.int64(15);
  l.hold_until = r.opt_int64(16);
  return l;
}

MemoryRow memory_of(const Row& r) {
  MemoryRow m;
  m.memory_id = r.str(0);
  m.tenant_id = r.str(1);
  m.parent_memory_id = r.opt_str(2);
  m.branched_at_token = r.opt_int64(3);
  m.fence_counter = r.int64(4);
  m.created_at = r.int64(5);
  m.revoked_token = r.opt_int64(6);
  m.revoke_reason = r.opt_str(7).value_or("");
  return m;
}

void write_lease(Mutations& m, const LeaseRow& l) {
  m.write("insertOrUpdate", "leases",
          {"memory_key", "memory_id", "lease_id", "tenant_id", "canonical_name", "display_name", "skeleton",
           "fencing_token", "owner_client_id", "ttl_seconds", "expires_at", "acquired_at", "holder", "granted_at",
           "renewed_at", "renewals", "hold_until"},
          json::array{spread_key(l.memory_id), l.memory_id, l.lease_id, l.tenant_id, l.canonical_name, l.display_name,
                      l.skeleton, int64_value(l.fencing_token), l.owner_client_id, int64_value(l.ttl_s),
                      int64_value(l.expires_at), int64_value(l.acquired_at),
                      l.holder.empty() ? json::value(nullptr) : json::value(l.holder), int64_value(l.granted_at),
                      opt_int64_value(l.renewed_at), int64_value(l.renewals), opt_int64_value(l.hold_until)});
}

json::array key_of(const std::string& memory_id) { return json::array{spread_key(memory_id)}; }

std::optional<IdemRecord> idem_of(const std::vector<Row>& rows) {
  if (rows.empty()) return std::nullopt;
  const Row& r = rows.front();
  IdemRecord rec;
  rec.fingerprint = r.str(0);
  rec.stored.status = static_cast<int>(r.int64(1));
  rec.stored.body = r.str(2);
  if (auto ra = r.opt_int64(3)) rec.stored.retry_after_s = static_cast<int>(*ra);
  rec.expires_at = r.int64(4);
  return rec;
}

std::string key_hash(std::string_view idem_key) { return sha256_hex(idem_key).substr(0, 8); }

void write_idem(Mutations& m, const std::string& tenant_id, const std::string& key, const std::string& fingerprint,
                const StoredOutcome& stored, UnixMs now) {
  m.write(
      "insertOrUpdate", "idempotency",
      {"tenant_id", "key_hash", "idem_key", "fingerprint", "status", "body", "retry_after", "created_at", "expires_at"},
      json::array{tenant_id, key_hash(key), key, fingerprint, int64_value(stored.status), stored.body,
                  stored.retry_after_s ? int64_value(*stored.retry_after_s) : json::value(nullptr), int64_value(now),
                  int64_value(now + k_idempotency_retention_ms)});
}

namespace {

Problem unavailable(const RpcError& e) {
  log::warn("spanner: {}", e.describe());
  Problem p(Code::unavailable, "the database is unavailable; retry later");
  p.retry_after_s = 1;
  return p;
}

// The idempotency barrier (SPEC §6.1 step 1) on a record read in the transaction: the
// outcome to answer without running the operation (a replay, or 422 for another request).
template <class T>
std::optional<Outcome<T>> barrier(const std::optional<IdemRecord>& rec, UnixMs now, const Idempotency& idem,
                                  const char** lookup) {
  if (!rec || rec->expires_at <= now) {
    *lookup = "miss";
    return std::nullopt;
  }
  if (rec->fingerprint != idem.fingerprint) {
    *lookup = "mismatch";
    return Outcome<T>(Problem(Code::idempotency_key_reused, "this Idempotency-Key was used with a different request"));
  }
  *lookup = "hit";
  return replay_outcome<T>(rec->stored);
}

// Whether an operation's outcome is kept under its key: every definite one (not a failure
// midway, whose outcome may be unknown), but a waiting claim's refusal as held
// (Claim::record_refusal).
template <class T>
bool keep_outcome(const expected<T, Problem>& v, bool record_refusal) {
  if (v) return true;
  return !outcome_may_be_unknown(v.error().code) && (record_refusal || v.error().kind() != Kind::held);
}

void count_lookup(const char* lookup) {
  Metrics::global().inc("mep_idempotency_lookups_total", std::string("result=\"") + lookup + "\"");
}

} // namespace

// ---- audit -------------------------------------------------------------------------------------

std::string SpannerStore::audit_salt(std::string& session, const std::string& tenant_id) {
  {
    std::lock_guard lock(m_salts_mutex);
    if (auto it = m_salts.find(tenant_id); it != m_salts.end()) return it->second;
  }
  auto r = read_once(session, "SELECT audit_salt FROM tenants WHERE tenant_id = @t", Params().str("t", tenant_id));
  if (!r) throw std::runtime_error("cannot read a tenant's audit salt: " + r.error().describe());
  std::string salt;
  for (const auto& row : rows_of(*r)) salt = row.str(0);
  std::lock_guard lock(m_salts_mutex);
  m_salts[tenant_id] = salt;
  return salt;
}

Rpc<void> SpannerStore::load_salts(Tx& tx, const std::vector<std::string>& tenants) {
  std::vector<std::string> missing;
  {
    std::lock_guard lock(m_salts_mutex);
    for (const auto& t : tenants)
      if (!m_salts.count(t) && std::find(missing.begin(), missing.end(), t) == missing.end()) missing.push_back(t);
  }
  if (missing.empty()) return {};
  auto r = tx.query("SELECT tenant_id, audit_salt FROM tenants WHERE tenant_id IN UNNEST(@ids)",
                    Params().str_array("ids", missing));
  if (!r) return make_unexpected(std::move(r.error()));
  std::lock_guard lock(m_salts_mutex);
  for (const auto& t : missing) m_salts[t] = ""; // a tenant without a row (AUTH_FAILED's): an empty key, as SQLite's
  for (const auto& row : rows_of(*r)) m_salts[row.str(0)] = row.str(1);
  return {};
}

void SpannerStore::add_audit(Mutations& m, const std::string& tenant_id, std::string_view type, std::string_view name,
                             std::string_view memory_id, std::optional<std::int64_t> token, UnixMs at,
                             std::optional<std::int64_t> renewals) {
  std::string salt;
  {
    std::lock_guard lock(m_salts_mutex);
    if (auto it = m_salts.find(tenant_id); it != m_salts.end()) salt = it->second;
  }
  HmacSha256 mac(salt);
  const std::string nh = name.empty() ? std::string() : mac.hex(name);
  const std::string mh = memory_id.empty() ? std::string() : mac.hex(memory_id);
  const std::string event_id = uuid_v7().to_string();
  // Rows of one name together (its history is a key range); others spread by memory or id.
  const std::string bucket = !nh.empty()   ? nh.substr(0, 8)
                             : !mh.empty() ? mh.substr(0, 8)
                                           : sha256_hex(event_id).substr(0, 8);
  m.write("insert", "audit_events",
          {"tenant_id", "bucket", "event_id", "event_type", "redacted_name_hash", "redacted_memory_hash",
           "fencing_token", "created_at", "renewals"},
          json::array{tenant_id, bucket, event_id, type, nh, mh, opt_int64_value(token), int64_value(at),
                      opt_int64_value(renewals)});
}

// ---- register --------------------------------------------------------------------------------------

void SpannerStore::register_memory(const Ctx& ctx, Idempotency idem, RegisterMemory req, Then<lease::Registered> then) {
  submit<lease::Registered>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](std::string& session) -> Outcome<lease::Registered> {
        const std::string id = req.memory_id.value_or(uuid_v7().to_string());
        (void)audit_salt(session, ctx.auth.tenant_id); // before the transaction: one per session
        std::optional<Outcome<lease::Registered>> out;
        const char* lookup = "miss";
        auto failed = run_rw(session, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
          auto r = tx.query(fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), "
                                        "ARRAY(SELECT AS STRUCT {} FROM idempotency WHERE tenant_id = @t AND "
                                        "key_hash = @kh AND idem_key = @k), "
                                        "ARRAY(SELECT AS STRUCT {} FROM memories WHERE memory_key = @mk)",
                                        k_idem_cols, k_memory_cols),
                            Params()
                                .str("t", ctx.auth.tenant_id)
                                .str("kh", key_hash(idem.key))
                                .str("k", idem.key)
                                .str("mk", spread_key(id)));
          if (!r) return make_unexpected(std::move(r.error()));
          const auto row = rows_of(*r).at(0);
          const UnixMs now = row.int64(0);
          Decision d;
          if (auto replay = barrier<lease::Registered>(idem_of(row.rows(1)), now, idem, &lookup)) {
            out = std::move(*replay);
            return d;
          }
          auto mem = row.rows(2);
          expected<lease::Registered, Problem> v = make_unexpected(Problem());
          if (!mem.empty()) {
            const MemoryRow m = memory_of(mem.front());
            if (m.tenant_id != ctx.auth.tenant_id)
              v = make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
            else
              v = lease::Registered{id, m.created_at, false};
          } else {
            d.mutations.write("insert", "memories",
                              {"memory_key", "memory_id", "tenant_id", "fence_counter", "created_at"},
                              json::array{spread_key(id), id, ctx.auth.tenant_id, int64_value(0), int64_value(now)});
            add_audit(d.mutations, ctx.auth.tenant_id, "MEMORY_REGISTERED", {}, id, std::nullopt, now);
            v = lease::Registered{id, now, true};
          }
          if (keep_outcome(v, true))
            write_idem(d.mutations, ctx.auth.tenant_id, idem.key, idem.fingerprint, store_outcome(v, ctx.request_id),
                       now);
          out = Outcome<lease::Registered>(std::move(v));
          return d;
        });
        if (failed) return std::move(*failed);
        count_lookup(lookup);
        return std::move(*out);
      },
      std::move(then));
}

// ---- claim ---------------------------------------------------------------------------------------

void SpannerStore::claim(const Ctx& ctx, Idempotency idem, Claim req, Then<lease::Grant> then) {
  std::optional<Ticket> ticket;
  if (req.ticket) {
    std::lock_guard lock(m_tickets_mutex);
    if (auto it = m_tickets.find(req.ticket); it != m_tickets.end()) ticket = it->second;
  }
  submit<lease::Grant>(
      [this, ctx, idem = std::move(idem), req = std::move(req), ticket](std::string& session) -> Outcome<lease::Grant> {
        (void)audit_salt(session, ctx.auth.tenant_id);
        std::optional<Outcome<lease::Grant>> out;
        std::vector<LeaseRow> ended; // expired leases the grant took over (for the metrics)
        const char* lookup = "miss";
        const bool named = req.name.has_value();
        auto failed = run_rw(session, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
          ended.clear();
          Params p;
          p.str("t", ctx.auth.tenant_id)
              .str("kh", key_hash(idem.key))
              .str("k", idem.key)
              .str("mk", spread_key(req.memory_id))
              .str("m", req.memory_id)
              .str("n", named ? req.name->canonical_name : std::string())
              .str("s", named ? req.name->skeleton : std::string())
              .timestamp("tts", ticket ? std::optional<std::string>(ticket->entered_at) : std::nullopt)
              .int64("wid", ticket ? ticket->waiter_id : 0);
          // Everything the rules need, in one statement: Spanner's clock, the key's record,
          // the memory, the leases sharing the memory, the name or the skeleton (by their
          // unique indexes), the name's history row, and the waiting claims ahead.
          auto r = tx.query(
              fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), "
                          "ARRAY(SELECT AS STRUCT {0} FROM idempotency WHERE tenant_id = @t AND key_hash = @kh AND "
                          "idem_key = @k), "
                          "ARRAY(SELECT AS STRUCT {1} FROM memories WHERE memory_key = @mk), "
                          "ARRAY(SELECT AS STRUCT {2} FROM leases WHERE memory_key = @mk "
                          "      OR canonical_name = @n OR skeleton = @s), "
                          "ARRAY(SELECT AS STRUCT first_claimed_at FROM agent_names WHERE canonical_name = @n), "
                          "(SELECT COUNT(*) FROM waiters WHERE (skeleton = @s OR memory_id = @m) AND NOT abandoned "
                          "  AND alive_until > UNIX_MILLIS(CURRENT_TIMESTAMP()) "
                          "  AND (@tts IS NULL OR entered_at < @tts OR (entered_at = @tts AND waiter_id < @wid)))",
                          k_idem_cols, k_memory_cols, k_lease_cols),
              p);
          if (!r) return make_unexpected(std::move(r.error()));
          const auto row = rows_of(*r).at(0);
          rules::ClaimView view;
          view.now = row.int64(0);
          const UnixMs now = view.now;
          Decision d;
          if (auto replay = barrier<lease::Grant>(idem_of(row.rows(1)), now, idem, &lookup)) {
            out = std::move(*replay);
            return d;
          }
          if (auto mem = row.rows(2); !mem.empty()) view.memory = memory_of(mem.front());
          for (const auto& l : row.rows(3)) {
            LeaseRow lease = lease_of(l);
            if (std::none_of(view.conflicts.begin(), view.conflicts.end(),
                             [&](const LeaseRow& c) { return c.memory_id == lease.memory_id; }))
              view.conflicts.push_back(std::move(lease));
          }
          const std::int64_t ahead = row.int64(5);
          rules::ClaimDecision decision = rules::decide_claim(
              ctx, req, view, [&] { return static_cast<std::size_t>(ahead); }, uuid_v7().to_string());
          // A refusal says how many claims wait for the resource, on every server (as
          // PostgreSQL's mep_wait_ext does): the position is not a secret, the holder is.
          if (!decision.outcome && decision.outcome.error().kind() == Kind::held && ahead > 0 &&
              !decision.outcome.error().extensions.contains("waiters"))
            decision.outcome.error().extensions["waiters"] = ahead;
          std::vector<std::string> tenants;
          for (const auto& note : decision.audit) tenants.push_back(note.tenant_id);
          if (auto loaded = load_salts(tx, tenants); !loaded) return make_unexpected(std::move(loaded.error()));
          for (const auto& note : decision.audit)
            add_audit(d.mutations, note.tenant_id, note.type, note.name, note.memory_id, note.token, now,
                      note.renewals);
          if (decision.outcome) {
            const LeaseRow& l = decision.lease;
            for (const auto& e : decision.removed)
              if (e.memory_id != l.memory_id) d.mutations.remove("leases", {key_of(e.memory_id)});
            for (const auto& e : view.conflicts)
              if (e.expires_at <= now) ended.push_back(e);
            d.mutations.write("update", "memories", {"memory_key", "fence_counter"},
                              json::array{spread_key(l.memory_id), int64_value(l.fencing_token)});
            write_lease(d.mutations, l);
            auto first = row.rows(4);
            const UnixMs first_claimed = first.empty() ? now : first.front().int64(0);
            d.mutations.write("insertOrUpdate", "agent_names",
                              {"canonical_name", "display_name", "skeleton", "tenant_id", "unicode_version",
                               "icu_version", "first_claimed_at", "last_claimed_at"},
                              json::array{l.canonical_name, l.display_name, l.skeleton, l.tenant_id, unicode_version(),
                                          icu_version(), int64_value(first_claimed), int64_value(now)});
            // A grant takes its ticket out of the queue, in its own commit.
            if (ticket) d.mutations.remove("waiters", {json::array{int64_value(ticket->waiter_id)}});
          }
          if (keep_outcome(decision.outcome, req.record_refusal))
            write_idem(d.mutations, ctx.auth.tenant_id, idem.key, idem.fingerprint,
                       store_outcome(decision.outcome, ctx.request_id), now);
          out = Outcome<lease::Grant>(std::move(decision.outcome));
          return d;
        });
        if (failed) return std::move(*failed);
        count_lookup(lookup);
        for (const auto& e : ended) count_lease_end(e, "taken_over", e.expires_at);
        if (out->ok() && !out->replayed && ticket) {
          std::lock_guard lock(m_tickets_mutex);
          m_tickets.erase(req.ticket);
        }
        return std::move(*out);
      },
      std::move(then));
}

// ---- renew ---------------------------------------------------------------------------------------

namespace {

// The leases and memories of a set of leases, read in the transaction.
struct Held {
  std::map<std::string, MemoryRow> memories; // by memory id
  std::map<std::string, LeaseRow> leases;    // by memory id
  UnixMs now = 0;
};

Rpc<Held> read_held(SpannerStore::Tx& tx, const std::vector<std::string>& memory_ids) {
  std::vector<std::string> keys;
  for (const auto& id : memory_ids) keys.push_back(spread_key(id));
  auto r = tx.query(fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), "
                                "ARRAY(SELECT AS STRUCT {} FROM memories WHERE memory_key IN UNNEST(@keys)), "
                                "ARRAY(SELECT AS STRUCT {} FROM leases WHERE memory_key IN UNNEST(@keys))",
                                k_memory_cols, k_lease_cols),
                    Params().str_array("keys", keys));
  if (!r) return make_unexpected(std::move(r.error()));
  const auto row = rows_of(*r).at(0);
  Held h;
  h.now = row.int64(0);
  for (const auto& m : row.rows(1)) {
    MemoryRow mem = memory_of(m);
    h.memories.emplace(mem.memory_id, std::move(mem));
  }
  for (const auto& l : row.rows(2)) {
    LeaseRow lease = lease_of(l);
    h.leases.emplace(lease.memory_id, std::move(lease));
  }
  return h;
}

template <class M>
std::optional<typename M::mapped_type> find_in(const M& map, const std::string& key) {
  auto it = map.find(key);
  if (it == map.end()) return std::nullopt;
  return it->second;
}

} // namespace

Outcome<std::vector<expected<lease::Renewed, Problem>>> SpannerStore::renew_all(std::string& session, const Ctx& ctx,
                                                                                const std::vector<LeaseRef>& refs) {
  (void)audit_salt(session, ctx.auth.tenant_id);
  std::vector<std::string> ids;
  for (const auto& ref : refs) ids.push_back(ref.memory_id);
  std::vector<expected<lease::Renewed, Problem>> results;
  int stale = 0;
  auto failed = run_rw(session, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
    results.clear();
    stale = 0;
    auto held = read_held(tx, ids);
    if (!held) return make_unexpected(std::move(held.error()));
    Decision d;
    const UnixMs now = held->now;
    std::map<std::string, LeaseRow> renewed; // later items see earlier ones' renewals
    for (const auto& ref : refs) {
      auto decide = [&]() -> expected<lease::Renewed, Problem> {
        if (auto p = rules::check_ttl(ref.ttl_s)) return make_unexpected(std::move(*p));
        auto lease = renewed.count(ref.memory_id) ? std::optional<LeaseRow>(renewed.at(ref.memory_id))
                                                  : find_in(held->leases, ref.memory_id);
        bool is_stale = false;
        auto live = rules::classify(ctx, find_in(held->memories, ref.memory_id), lease, ref.fencing_token, now,
                                    Code::lease_not_found, &is_stale);
        if (is_stale) {
          ++stale;
          add_audit(d.mutations, ctx.auth.tenant_id, "STALE_FENCE_REJECTED", {}, ref.memory_id, ref.fencing_token, now);
        }
        if (!live) return make_unexpected(std::move(live.error()));
        auto expires = rules::decide_renew(*live, ref, now);
        if (!expires) return make_unexpected(std::move(expires.error()));
        LeaseRow l = *live;
        l.expires_at = *expires;
        l.ttl_s = ref.ttl_s;
        l.renewed_at = now;
        l.renewals += 1;
        renewed[l.memory_id] = l;
        return lease::Renewed{*expires, ref.ttl_s, now};
      };
      results.push_back(decide());
    }
    for (const auto& [id, l] : renewed)
      d.mutations.write("update", "leases", {"memory_key", "expires_at", "ttl_seconds", "renewed_at", "renewals"},
                        json::array{spread_key(id), int64_value(l.expires_at), int64_value(l.ttl_s),
                                    opt_int64_value(l.renewed_at), int64_value(l.renewals)});
    return d;
  });
  if (failed) return std::move(*failed);
  if (stale) Metrics::global().inc("mep_fencing_rejections_total", {}, stale);
  return results;
}

void SpannerStore::renew(const Ctx& ctx, LeaseRef ref, Then<lease::Renewed> then) {
  submit<lease::Renewed>(
      [this, ctx, ref = std::move(ref)](std::string& session) -> Outcome<lease::Renewed> {
        auto all = renew_all(session, ctx, {ref});
        if (!all.ok()) return std::move(all.value.error());
        return Outcome<lease::Renewed>(std::move(all.value->front()));
      },
      std::move(then));
}

void SpannerStore::renew_batch(const Ctx& ctx, RenewBatch req, Then<lease::RenewBatchResult> then) {
  submit<lease::RenewBatchResult>(
      [this, ctx, req = std::move(req)](std::string& session) mutable -> Outcome<lease::RenewBatchResult> {
        for (auto& ref : req.leases)
          if (ref.owner_client_id.empty()) ref.owner_client_id = req.owner_client_id;
        auto all = renew_all(session, ctx, req.leases);
        if (!all.ok()) return std::move(all.value.error());
        lease::RenewBatchResult out;
        for (std::size_t i = 0; i < req.leases.size(); ++i)
          out.results.push_back(renew_item(req.leases[i].canonical_name, (*all.value)[i]));
        return out;
      },
      std::move(then));
}

// ---- release, verify, revoke ------------------------------------------------------------------------

void SpannerStore::release(const Ctx& ctx, LeaseRef ref, Then<Released> then) {
  submit<Released>(
      [this, ctx, ref = std::move(ref)](std::string& session) -> Outcome<Released> {
        (void)audit_salt(session, ctx.auth.tenant_id);
        std::optional<Outcome<Released>> out;
        std::optional<std::pair<LeaseRow, const char*>> ended;
        UnixMs ended_at = 0;
        bool stale = false;
        auto failed = run_rw(session, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
          ended.reset();
          auto held = read_held(tx, {ref.memory_id});
          if (!held) return make_unexpected(std::move(held.error()));
          Decision d;
          const UnixMs now = held->now;
          ended_at = now;
          auto row = find_in(held->leases, ref.memory_id);
          auto live = rules::classify(ctx, find_in(held->memories, ref.memory_id), row, ref.fencing_token, now,
                                      Code::lease_not_found, &stale);
          if (stale)
            add_audit(d.mutations, ctx.auth.tenant_id, "STALE_FENCE_REJECTED", {}, ref.memory_id, ref.fencing_token,
                      now);
          auto freed = [&](const LeaseRow& l) {
            d.mutations.remove("leases", {key_of(l.memory_id)});
            d.mutations.write(
                "insert", "lease_frees", {"free_id", "canonical_name", "memory_id", "freed_at"},
                json::array{uuid_v7().to_string(), l.canonical_name, l.memory_id, "spanner.commit_timestamp()"});
          };
          if (!live) {
            if (live.error().code != Code::lease_expired) {
              out = Outcome<Released>(std::move(live.error()));
              return d;
            }
            // Already released or expired with the current token: idempotent success; an
            // expired row left for the sweeper is removed now.
            if (row && row->fencing_token == ref.fencing_token) {
              if (auto loaded = load_salts(tx, {row->tenant_id}); !loaded)
                return make_unexpected(std::move(loaded.error()));
              freed(*row);
              add_audit(d.mutations, row->tenant_id, "LEASE_EXPIRED", row->canonical_name, row->memory_id,
                        row->fencing_token, now, row->renewals);
              ended.emplace(*row, "expired");
              ended_at = row->expires_at;
            }
            out = Outcome<Released>(Released{});
            return d;
          }
          if (live->canonical_name != ref.canonical_name || live->owner_client_id != ref.owner_client_id) {
            out = Outcome<Released>(Problem(Code::lease_not_found, "no lease of this owner under this name"));
            return d;
          }
          freed(*live);
          add_audit(d.mutations, ctx.auth.tenant_id, "LEASE_RELEASED", live->canonical_name, live->memory_id,
                    live->fencing_token, now, live->renewals);
          ended.emplace(*live, "released");
          out = Outcome<Released>(Released{});
          return d;
        });
        if (failed) return std::move(*failed);
        if (stale) Metrics::global().inc("mep_fencing_rejections_total");
        if (ended) count_lease_end(ended->first, ended->second, ended_at);
        return std::move(*out);
      },
      std::move(then));
}

void SpannerStore::verify(const Ctx& ctx, Verify req, Then<lease::Verified> then) {
  submit<lease::Verified>(
      [this, ctx, req = std::move(req)](std::string& session) -> Outcome<lease::Verified> {
        // A read-only transaction (one call); a stale token's audit row is a blind write.
        auto r = read_once(session,
                           fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), "
                                       "ARRAY(SELECT AS STRUCT {} FROM memories WHERE memory_key = @mk), "
                                       "ARRAY(SELECT AS STRUCT {} FROM leases WHERE memory_key = @mk)",
                                       k_memory_cols, k_lease_cols),
                           Params().str("mk", spread_key(req.memory_id)));
        if (!r) return unavailable(r.error());
        const auto row = rows_of(*r).at(0);
        const UnixMs now = row.int64(0);
        std::optional<MemoryRow> mem;
        std::optional<LeaseRow> lease;
        if (auto m = row.rows(1); !m.empty()) mem = memory_of(m.front());
        if (auto l = row.rows(2); !l.empty()) lease = lease_of(l.front());
        bool stale = false;
        auto live = rules::classify(ctx, mem, lease, req.fencing_token, now, Code::memory_not_found, &stale);
        if (stale) {
          Metrics::global().inc("mep_fencing_rejections_total");
          Mutations m;
          add_audit(m, ctx.auth.tenant_id, "STALE_FENCE_REJECTED", {}, req.memory_id, req.fencing_token, now);
          (void)write_once(session, m);
        }
        if (!live) return std::move(live.error());
        return lease::Verified{live->memory_id, live->fencing_token, live->canonical_name, live->expires_at, now};
      },
      std::move(then));
}

void SpannerStore::revoke(const Ctx& ctx, Revoke req, Then<Revoked> then) {
  submit<Revoked>(
      [this, ctx, req = std::move(req)](std::string& session) -> Outcome<Revoked> {
        (void)audit_salt(session, ctx.auth.tenant_id);
        std::optional<Outcome<Revoked>> out;
        std::optional<LeaseRow> ended;
        UnixMs at = 0;
        // Not repeated after an unknown commit: a second run would find no lease and say so.
        auto failed = run_rw(session, Repeat::unsafe, [&](Tx& tx) -> Rpc<Decision> {
          ended.reset();
          auto r = tx.query(fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), "
                                        "ARRAY(SELECT AS STRUCT {} FROM leases WHERE canonical_name = @n)",
                                        k_lease_cols),
                            Params().str("n", req.canonical_name));
          if (!r) return make_unexpected(std::move(r.error()));
          const auto row = rows_of(*r).at(0);
          at = row.int64(0);
          Decision d;
          auto leases = row.rows(1);
          if (leases.empty()) {
            out = Outcome<Revoked>(Problem(Code::lease_not_found, "no live lease under this name"));
            return d;
          }
          LeaseRow l = lease_of(leases.front());
          if (l.tenant_id != ctx.auth.tenant_id || l.expires_at <= at) {
            out = Outcome<Revoked>(Problem(Code::lease_not_found, "no live lease under this name"));
            return d;
          }
          d.mutations.remove("leases", {key_of(l.memory_id)});
          // The memory remembers the revocation: its holder's next renewal learns why.
          d.mutations.write("update", "memories", {"memory_key", "revoked_token", "revoke_reason"},
                            json::array{spread_key(l.memory_id), int64_value(l.fencing_token),
                                        req.reason.empty() ? json::value(nullptr) : json::value(req.reason)});
          d.mutations.write(
              "insert", "lease_frees", {"free_id", "canonical_name", "memory_id", "freed_at"},
              json::array{uuid_v7().to_string(), l.canonical_name, l.memory_id, "spanner.commit_timestamp()"});
          add_audit(d.mutations, ctx.auth.tenant_id, "LEASE_REVOKED", l.canonical_name, l.memory_id, l.fencing_token,
                    at, l.renewals);
          ended = l;
          out = Outcome<Revoked>(Revoked{l.canonical_name, l.memory_id});
          return d;
        });
        if (failed) return std::move(*failed);
        if (ended) count_lease_end(*ended, "revoked", at);
        return std::move(*out);
      },
      std::move(then));
}

// ---- branch -------------------------------------------------------------------------------------

void SpannerStore::branch(const Ctx& ctx, Idempotency idem, Branch req, Then<lease::Branched> then) {
  submit<lease::Branched>(
      [this, ctx, idem = std::move(idem), req = std::move(req)](std::string& session) -> Outcome<lease::Branched> {
        (void)audit_salt(session, ctx.auth.tenant_id);
        const std::string child = req.memory_id.value_or(uuid_v7().to_string());
        std::optional<Outcome<lease::Branched>> out;
        const char* lookup = "miss";
        bool stale = false;
        auto failed = run_rw(session, Repeat::safe, [&](Tx& tx) -> Rpc<Decision> {
          auto r = tx.query(
              fmt::format("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), "
                          "ARRAY(SELECT AS STRUCT {0} FROM idempotency WHERE tenant_id = @t AND key_hash = @kh AND "
                          "idem_key = @k), "
                          "ARRAY(SELECT AS STRUCT {1} FROM memories WHERE memory_key = @pk), "
                          "ARRAY(SELECT AS STRUCT {2} FROM leases WHERE memory_key = @pk), "
                          "ARRAY(SELECT AS STRUCT {1} FROM memories WHERE memory_key = @ck)",
                          k_idem_cols, k_memory_cols, k_lease_cols),
              Params()
                  .str("t", ctx.auth.tenant_id)
                  .str("kh", key_hash(idem.key))
                  .str("k", idem.key)
                  .str("pk", spread_key(req.parent_memory_id))
                  .str("ck", spread_key(child)));
          if (!r) return make_unexpected(std::move(r.error()));
          const auto row = rows_of(*r).at(0);
          const UnixMs now = row.int64(0);
          Decision d;
          if (auto replay = barrier<lease::Branched>(idem_of(row.rows(1)), now, idem, &lookup)) {
            out = std::move(*replay);
            return d;
          }
          auto decide = [&]() -> expected<lease::Branched, Problem> {
            // A client-minted id makes a retry naturally idempotent (as SQLite's branch).
            if (auto existing = row.rows(4); !existing.empty()) {
              const MemoryRow m = memory_of(existing.front());
              if (req.memory_id && m.tenant_id == ctx.auth.tenant_id && m.parent_memory_id == req.parent_memory_id &&
                  m.branched_at_token == req.parent_fencing_token)
                return lease::Branched{child, req.parent_memory_id, req.parent_fencing_token, false};
              return make_unexpected(Problem(Code::memory_id_taken, "this memory id is taken"));
            }
            std::optional<MemoryRow> parent;
            std::optional<LeaseRow> lease;
            if (auto m = row.rows(2); !m.empty()) parent = memory_of(m.front());
            if (auto l = row.rows(3); !l.empty()) lease = lease_of(l.front());
            auto live =
                rules::classify(ctx, parent, lease, req.parent_fencing_token, now, Code::memory_not_found, &stale);
            if (stale)
              add_audit(d.mutations, ctx.auth.tenant_id, "STALE_FENCE_REJECTED", {}, req.parent_memory_id,
                        req.parent_fencing_token, now);
            if (!live) return make_unexpected(std::move(live.error()));
            d.mutations.write("insert", "memories",
                              {"memory_key", "memory_id", "tenant_id", "parent_memory_id", "branched_at_token",
                               "fence_counter", "created_at"},
                              json::array{spread_key(child), child, ctx.auth.tenant_id, req.parent_memory_id,
                                          int64_value(req.parent_fencing_token), int64_value(0), int64_value(now)});
            add_audit(d.mutations, ctx.auth.tenant_id, "MEMORY_BRANCHED", {}, child, req.parent_fencing_token, now);
            return lease::Branched{child, req.parent_memory_id, req.parent_fencing_token, true};
          };
          auto v = decide();
          if (keep_outcome(v, true))
            write_idem(d.mutations, ctx.auth.tenant_id, idem.key, idem.fingerprint, store_outcome(v, ctx.request_id),
                       now);
          out = Outcome<lease::Branched>(std::move(v));
          return d;
        });
        if (failed) return std::move(*failed);
        count_lookup(lookup);
        if (stale) Metrics::global().inc("mep_fencing_rejections_total");
        return std::move(*out);
      },
      std::move(then));
}

} // namespace mep::server::spanner
