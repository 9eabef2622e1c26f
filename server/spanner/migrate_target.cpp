// mep migrate on Cloud Spanner: the Target of migrate.cpp over the Spanner store's sessions
// and read-write transactions.
//
// Design notes.
// * A batch is written in transactions of up to k_spanner_batch rows (a commit carries at
//   most 80,000 mutated cells; a row writes about 28). Each transaction reads, in its first
//   statement, which of its legacy ids, memories, identity-map references and names exist
//   already, and inserts only the others: the INSERT … ON CONFLICT DO NOTHING of the other
//   backends, and a transaction that runs again after a commit whose outcome was unknown
//   writes nothing twice (so it is run again, Repeat::safe).
// * One run at a time: Spanner has no advisory lock, so a run holds a row of settings,
//   `migration_run` = "<run id> <expiry ms>", for k_run_lock_ms on Spanner's clock, taken
//   at open and renewed by every transaction of the run, which first checks that the row is
//   still its own (a run paused past the expiry and overtaken by another stops with
//   RunInProgress instead of writing beside it). A crashed run's row expires; a finished
//   run deletes it.
// * Reads page through the tables in key order (k_page rows a call): a REST answer is one
//   JSON document, and a migration may hold millions of rows.
// * `--from-table` reads a table of the database itself; on Spanner it is refused (export
//   the table as JSON Lines or CSV and give --input).
#include "mep/log.hpp"
#include "mep/migrate_rows.hpp"
#include "mep/problem.hpp"
#include "mep/random.hpp"
#include "mep/spanner/auth.hpp"
#include "mep/spanner/store.hpp"
#include "mep/store.hpp"

#include <boost/json/array.hpp>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <unordered_set>

namespace mep::server::migration {
namespace {
namespace json = boost::json;
using spanner::Mutations;
using spanner::Params;
using spanner::rows_of;
using spanner::Rpc;
using spanner::SpannerStore;

constexpr std::size_t k_spanner_batch = 1000;
constexpr std::int64_t k_run_lock_ms = 30'000;
constexpr std::int64_t k_page = 5000;
// How long a transaction the store gave up on is run again before the run stops (a slow or
// busy database; the run's lock is renewed by each attempt that gets through).
constexpr std::chrono::seconds k_retry_budget{120};
constexpr const char* k_run_lock_key = "migration_run";

class SpannerTarget final : public StatusTarget {
public:
  SpannerTarget(std::unique_ptr<SpannerStore> store, bool lock) : m_store(std::move(store)) {
    if (!lock) return;
    m_run_id = random_hex(16);
    m_locking = true;
    transact("take the run's lock", [&](SpannerStore::Tx& tx) -> Rpc<SpannerStore::Decision> {
      SpannerStore::Decision d;
      auto now = lock_checked(tx, d.mutations);
      if (!now) return make_unexpected(std::move(now.error()));
      return d;
    });
    m_locked = true;
  }

  ~SpannerTarget() override {
    if (!m_locked) return;
    try { // the row is deleted only while it is this run's
      m_store->with_session([&](std::string& s) {
        (void)m_store->run_rw(s, SpannerStore::Repeat::safe, [&](SpannerStore::Tx& tx) -> Rpc<SpannerStore::Decision> {
          auto r = tx.query("SELECT value FROM settings WHERE key = @k", Params().str("k", k_run_lock_key));
          if (!r) return make_unexpected(std::move(r.error()));
          SpannerStore::Decision d;
          for (const auto& row : rows_of(*r))
            if (row.str(0).rfind(m_run_id + " ", 0) == 0) d.mutations.remove("settings", {json::array{k_run_lock_key}});
          return d;
        });
      });
    } catch (const std::exception&) {
      // It expires on its own.
    }
  }

  bool has_tables() override { return true; } // the store created the schema, or it was there

  expected<Rows, std::string> read_table(const std::string&) override {
    return make_unexpected(std::string("--from-table is not supported on Spanner: export the table as JSON Lines or "
                                       "CSV and give it with --input"));
  }

  std::string tenant_id(const std::string& name) override {
    std::string id;
    read("find the tenant", "SELECT tenant_id FROM tenants WHERE name = @n", Params().str("n", name),
         [&](const spanner::Row& r) { id = r.str(0); });
    return id;
  }

  void each_migrated(const std::function<void(Migrated&&)>& f) override {
    paged("read the rows of earlier runs",
          "SELECT legacy_id, canonical_name, skeleton, action, reason, memory_instance_id FROM migration_rows "
          "WHERE legacy_id > @after ORDER BY legacy_id LIMIT @page",
          {}, [&](const spanner::Row& r) {
            f(Migrated{r.str(0), r.str(1), r.str(2), r.str(3), r.opt_str(4).value_or(""), r.str(5)});
            return r.str(0);
          });
  }

  void each_name(const std::function<void(std::string, std::string)>& f) override {
    paged("read the names in use",
          "SELECT a.canonical_name, a.skeleton FROM agent_names a WHERE a.canonical_name > @after AND NOT EXISTS "
          "(SELECT 1 FROM migration_rows m WHERE m.canonical_name = a.canonical_name) "
          "ORDER BY a.canonical_name LIMIT @page",
          {}, [&](const spanner::Row& r) {
            std::string name = r.str(0);
            f(name, r.str(1));
            return name;
          });
  }

  void each_identity(const std::string& tenant, const std::function<void(std::string, std::string)>& f) override {
    if (tenant.empty()) return; // no tenant yet: nothing mapped
    paged("read the identity map",
          "SELECT legacy_memory_ref, memory_instance_id FROM migration_identity_map WHERE tenant_id = @t AND "
          "legacy_memory_ref > @after ORDER BY legacy_memory_ref LIMIT @page",
          tenant, [&](const spanner::Row& r) {
            std::string ref = r.str(0);
            f(ref, r.str(1));
            return ref;
          });
  }

  std::string ensure_tenant(const std::string& name) override {
    transact("create the tenant", [&](SpannerStore::Tx& tx) -> Rpc<SpannerStore::Decision> {
      SpannerStore::Decision d;
      auto now = lock_checked(tx, d.mutations);
      if (!now) return make_unexpected(std::move(now.error()));
      auto r = tx.query("SELECT tenant_id FROM tenants WHERE name = @n", Params().str("n", name));
      if (!r) return make_unexpected(std::move(r.error()));
      if (rows_of(*r).empty())
        d.mutations.write("insert", "tenants", {"tenant_id", "name", "audit_salt", "created_at"},
                          json::array{uuid_v7().to_string(), name, random_hex(32), spanner::int64_value(*now)});
      return d;
    });
    return tenant_id(name);
  }

  void mark_in_progress() override {
    transact("mark the migration in progress", [&](SpannerStore::Tx& tx) -> Rpc<SpannerStore::Decision> {
      SpannerStore::Decision d;
      auto now = lock_checked(tx, d.mutations);
      if (!now) return make_unexpected(std::move(now.error()));
      auto r = tx.query("SELECT value FROM settings WHERE key = 'migration_state'");
      if (!r) return make_unexpected(std::move(r.error()));
      const auto found = rows_of(*r);
      if (found.empty() || found.front().str(0) != "active")
        d.mutations.write("insertOrUpdate", "settings", {"key", "value"},
                          json::array{"migration_state", "in-progress"});
      return d;
    });
  }

  void write(const std::string& tenant, const std::vector<const Row*>& batch, const std::string& uv,
             const std::string& iv) override {
    for (std::size_t from = 0; from < batch.size(); from += k_spanner_batch) {
      const std::vector<const Row*> part(
          batch.begin() + static_cast<std::ptrdiff_t>(from),
          batch.begin() + static_cast<std::ptrdiff_t>(std::min(batch.size(), from + k_spanner_batch)));
      transact("write a batch", [&](SpannerStore::Tx& tx) { return write_part(tx, tenant, part, uv, iv); });
    }
  }

  std::string state() override {
    std::string value = "none";
    read("read the migration state", "SELECT value FROM settings WHERE key = 'migration_state'", {},
         [&](const spanner::Row& r) { value = r.str(0); });
    return value;
  }

  void activate() override { // a blind write: nothing to read first
    Mutations m;
    m.write("insertOrUpdate", "settings", {"key", "value"}, json::array{"migration_state", "active"});
    Rpc<void> r = make_unexpected(spanner::RpcError{});
    m_store->with_session([&](std::string& s) { r = m_store->write_once(s, m); });
    if (!r) throw std::runtime_error("cannot activate the migration on Spanner: " + r.error().describe());
  }

  std::vector<std::pair<std::string, std::int64_t>> action_counts() override {
    std::vector<std::pair<std::string, std::int64_t>> out;
    read("count the migrated rows", "SELECT action, COUNT(*) FROM migration_rows GROUP BY action", {},
         [&](const spanner::Row& r) { out.emplace_back(r.str(0), r.int64(1)); });
    return out;
  }

  std::int64_t identity_entries() override {
    std::int64_t n = 0;
    read("count the identity map", "SELECT COUNT(*) FROM migration_identity_map", {},
         [&](const spanner::Row& r) { n = r.int64(0); });
    return n;
  }

private:
  // Spanner's time, after checking that the run's lock row is this run's (or free, or
  // expired) and renewing it in `m`. Only a run (not a plan or status) holds one.
  Rpc<std::int64_t> lock_checked(SpannerStore::Tx& tx, Mutations& m) {
    auto r = tx.query("SELECT UNIX_MILLIS(CURRENT_TIMESTAMP()), ARRAY(SELECT AS STRUCT value FROM settings "
                      "WHERE key = @k)",
                      Params().str("k", k_run_lock_key));
    if (!r) return make_unexpected(std::move(r.error()));
    const auto row = rows_of(*r).at(0);
    const std::int64_t now = row.int64(0);
    if (!m_locking) return now;
    for (const auto& held : row.rows(1)) {
      const std::string value = held.str(0);
      const auto space = value.find(' ');
      const std::string holder = value.substr(0, space);
      std::int64_t until = 0;
      try {
        until = space == std::string::npos ? 0 : std::stoll(value.substr(space + 1));
      } catch (const std::exception&) {
        until = 0; // unreadable: treated as expired
      }
      if (holder != m_run_id && until > now) {
        m_lost = true; // answered after the transaction ends (rolled back: no mutations)
        m = Mutations();
        return now;
      }
    }
    m.write("insertOrUpdate", "settings", {"key", "value"},
            json::array{k_run_lock_key, m_run_id + " " + std::to_string(now + k_run_lock_ms)});
    return now;
  }

  Rpc<SpannerStore::Decision> write_part(SpannerStore::Tx& tx, const std::string& tenant,
                                         const std::vector<const Row*>& part, const std::string& uv,
                                         const std::string& iv) {
    SpannerStore::Decision d;
    std::vector<std::string> ids, keys, refs, names;
    for (const Row* r : part) {
      ids.push_back(r->legacy_id);
      keys.push_back(spanner::spread_key(r->memory_id.to_string()));
      if (!r->legacy_memory_ref.empty()) refs.push_back(r->legacy_memory_ref);
      names.push_back(r->canonical);
    }
    auto now = lock_checked(tx, d.mutations);
    if (!now) return make_unexpected(std::move(now.error()));
    if (m_lost) return d;
    // What of the part is there already, read by primary key. A query (`… IN UNNEST(@ids)`)
    // makes the emulator scan each table and test every row against every listed key: 13 s
    // for a part of 1,000 on 4,000 rows on a busy machine, past the call's 10 s (and each
    // retry queued behind the query before it); the four reads took 0.1 s.
    auto present = [&](const char* table, const char* column,
                       json::array listed) -> Rpc<std::unordered_set<std::string>> {
      std::unordered_set<std::string> s;
      if (listed.empty()) return s;
      auto r = tx.read(table, {column}, std::move(listed));
      if (!r) return make_unexpected(std::move(r.error()));
      for (const auto& x : rows_of(*r)) s.insert(x.str(0));
      return s;
    };
    auto keys_of = [](const std::vector<std::string>& v, const std::string* prefix = nullptr) {
      json::array a;
      for (const auto& k : v) a.push_back(prefix ? json::array{*prefix, k} : json::array{k});
      return a;
    };
    auto done = present("migration_rows", "legacy_id", keys_of(ids));
    if (!done) return make_unexpected(std::move(done.error()));
    auto memories = present("memories", "memory_key", keys_of(keys));
    if (!memories) return make_unexpected(std::move(memories.error()));
    auto mapped = present("migration_identity_map", "legacy_memory_ref", keys_of(refs, &tenant));
    if (!mapped) return make_unexpected(std::move(mapped.error()));
    auto used = present("agent_names", "canonical_name", keys_of(names));
    if (!used) return make_unexpected(std::move(used.error()));
    for (const Row* p : part) {
      if (!done->insert(p->legacy_id).second) continue; // written by an earlier attempt
      const std::string memory = p->memory_id.to_string();
      d.mutations.write(
          "insert", "migration_rows",
          {"legacy_id", "tenant_id", "display_name", "canonical_name", "skeleton", "action", "reason",
           "memory_instance_id", "legacy_memory_ref", "legacy_created_at", "migrated_at"},
          json::array{p->legacy_id, tenant, p->display_name, p->canonical, p->skeleton, action_name(p->action),
                      spanner::opt_str_value(p->reason_code ? std::optional<std::string>(p->reason()) : std::nullopt),
                      memory, p->legacy_memory_ref, p->created_at(), spanner::int64_value(*now)});
      if (memories->insert(spanner::spread_key(memory)).second)
        d.mutations.write("insert", "memories", {"memory_key", "memory_id", "tenant_id", "fence_counter", "created_at"},
                          json::array{spanner::spread_key(memory), memory, tenant, spanner::int64_value(0),
                                      spanner::int64_value(*now)});
      if (!p->legacy_memory_ref.empty() && mapped->insert(p->legacy_memory_ref).second)
        d.mutations.write("insert", "migration_identity_map", {"tenant_id", "legacy_memory_ref", "memory_instance_id"},
                          json::array{tenant, p->legacy_memory_ref, memory});
      if (used->insert(p->canonical).second)
        d.mutations.write("insert", "agent_names",
                          {"canonical_name", "display_name", "skeleton", "tenant_id", "unicode_version", "icu_version",
                           "first_claimed_at", "last_claimed_at"},
                          json::array{p->canonical, p->display_name, p->skeleton, tenant, uv, iv,
                                      spanner::int64_value(*now), spanner::int64_value(*now)});
    }
    return d;
  }

  // One read-write transaction (retried when aborted); RunInProgress when the run's lock
  // was found another's. A transaction the store gave up on (no answer within its budget,
  // or aborted again and again: a slow or busy database) runs again, for up to
  // k_retry_budget: each writes only what is not there yet, so a commit whose outcome was
  // unknown is not written twice.
  void transact(const char* what, const std::function<Rpc<SpannerStore::Decision>(SpannerStore::Tx&)>& body) {
    const auto give_up = std::chrono::steady_clock::now() + k_retry_budget;
    for (std::chrono::seconds pause{1};; pause = std::min(pause * 2, std::chrono::seconds(8))) {
      std::optional<Problem> failed;
      m_store->with_session([&](std::string& s) { failed = m_store->run_rw(s, SpannerStore::Repeat::safe, body); });
      if (m_lost) throw RunInProgress{};
      if (!failed) return;
      const bool again = failed->code == Code::unavailable || failed->code == Code::transaction_conflict;
      if (!again || std::chrono::steady_clock::now() + pause >= give_up)
        throw std::runtime_error(std::string("cannot ") + what + " on Spanner: " + failed->detail);
      log::warn("spanner: cannot {} yet ({}); trying again in {} s", what, failed->detail, pause.count());
      std::this_thread::sleep_for(pause);
    }
  }

  void read(const char* what, const std::string& sql, const Params& params,
            const std::function<void(const spanner::Row&)>& f) {
    Rpc<json::object> r = make_unexpected(spanner::RpcError{});
    m_store->with_session([&](std::string& s) { r = m_store->read_once(s, sql, params); });
    if (!r) throw std::runtime_error(std::string("cannot ") + what + " on Spanner: " + r.error().describe());
    for (const auto& row : rows_of(*r)) f(row);
  }

  // Pages of `sql` (with @after, @page and, when given, @t): `f` returns each row's key.
  void paged(const char* what, const std::string& sql, const std::string& tenant,
             const std::function<std::string(const spanner::Row&)>& f) {
    std::string after;
    for (;;) {
      Params p;
      p.str("after", after).int64("page", k_page);
      if (!tenant.empty()) p.str("t", tenant);
      std::int64_t n = 0;
      read(what, sql, p, [&](const spanner::Row& r) {
        after = f(r);
        ++n;
      });
      if (n < k_page) return;
    }
  }

  std::unique_ptr<SpannerStore> m_store;
  std::string m_run_id;
  bool m_locking = false; // this target is a run's: its transactions check and renew the lock
  bool m_locked = false;
  bool m_lost = false;
};

} // namespace

std::unique_ptr<StatusTarget> open_spanner_target(const std::string& url, bool create) {
  if (!create) {
    // Nothing is written: without mep's schema there is nothing to read.
    auto loc = spanner::parse_location(url);
    if (!loc) throw std::runtime_error(loc.error());
    spanner::CurlTransport transport;
    auto tokens = spanner::default_tokens(loc->endpoint, transport);
    spanner::Rest rest(loc->endpoint, loc->database, transport, *tokens);
    auto ddl = rest.get_ddl();
    if (!ddl) throw std::runtime_error("cannot read the database's schema: " + ddl.error().describe());
    const bool ours = std::any_of(ddl->begin(), ddl->end(), [](const std::string& s) {
      return s.rfind("CREATE TABLE migration_rows", 0) == 0 || s.rfind("CREATE TABLE `migration_rows`", 0) == 0;
    });
    if (!ours) return nullptr;
  }
  StoreOptions options;
  options.pool = 1;
  return std::make_unique<SpannerTarget>(std::make_unique<SpannerStore>(url, options), create);
}

} // namespace mep::server::migration
