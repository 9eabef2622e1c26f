// The Spanner store's schema (GoogleSQL DDL), versioned like the other backends and applied
// at start-up: an empty database is initialised; a database whose tables of mep's names are
// not mep's is refused, untouched; one from a newer mep is refused.
//
// The tables are SQLite's and PostgreSQL's, with their column names (times are INT64
// milliseconds, read from Spanner's clock), and keys that spread writes: a memory's rows
// under spread_key(id), audit rows under their name's (or memory's) hash, idempotency records
// under a hash of their key. No index on a time-ordered column (a hot spot).
#include "mep/spanner/store.hpp"

#include "mep/log.hpp"

#include <boost/json/array.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <thread>

namespace mep::server::spanner {
namespace json = boost::json;

namespace {

// Version 1: the whole schema of mep 0.x as of issue 51 (holders, hold limits, revocations,
// waiting claims and freed leases included).
const std::vector<std::string> k_schema_v1 = {
    R"(CREATE TABLE tenants (
  tenant_id STRING(36) NOT NULL,
  name STRING(MAX) NOT NULL,
  audit_salt STRING(MAX) NOT NULL,
  created_at INT64 NOT NULL
) PRIMARY KEY (tenant_id))",
    "CREATE UNIQUE INDEX tenants_by_name ON tenants(name)",
    R"(CREATE TABLE tokens (
  token_id STRING(36) NOT NULL,
  tenant_id STRING(36) NOT NULL,
  token_sha256 STRING(64) NOT NULL,
  scopes STRING(MAX) NOT NULL,
  created_at INT64 NOT NULL,
  revoked_at INT64
) PRIMARY KEY (token_id))",
    "CREATE UNIQUE INDEX tokens_by_sha256 ON tokens(token_sha256)",
    R"(CREATE TABLE memories (
  memory_key STRING(64) NOT NULL,
  memory_id STRING(36) NOT NULL,
  tenant_id STRING(36) NOT NULL,
  parent_memory_id STRING(36),
  branched_at_token INT64,
  fence_counter INT64 NOT NULL,
  created_at INT64 NOT NULL,
  revoked_token INT64,
  revoke_reason STRING(MAX),
  CONSTRAINT memories_fence CHECK (fence_counter >= 0)
) PRIMARY KEY (memory_key))",
    "CREATE INDEX memories_by_parent ON memories(parent_memory_id)",
    R"(CREATE TABLE leases (
  memory_key STRING(64) NOT NULL,
  memory_id STRING(36) NOT NULL,
  lease_id STRING(36) NOT NULL,
  tenant_id STRING(36) NOT NULL,
  canonical_name STRING(MAX) NOT NULL,
  display_name STRING(MAX) NOT NULL,
  skeleton STRING(MAX) NOT NULL,
  fencing_token INT64 NOT NULL,
  owner_client_id STRING(MAX) NOT NULL,
  ttl_seconds INT64 NOT NULL,
  expires_at INT64 NOT NULL,
  acquired_at INT64 NOT NULL,
  holder STRING(MAX),
  granted_at INT64,
  renewed_at INT64,
  renewals INT64 NOT NULL,
  hold_until INT64,
  CONSTRAINT leases_token CHECK (fencing_token > 0)
) PRIMARY KEY (memory_key))",
    "CREATE UNIQUE INDEX leases_by_name ON leases(canonical_name)",
    "CREATE UNIQUE INDEX leases_by_skeleton ON leases(skeleton)",
    "CREATE INDEX leases_by_tenant ON leases(tenant_id, canonical_name)",
    R"(CREATE TABLE agent_names (
  canonical_name STRING(MAX) NOT NULL,
  display_name STRING(MAX) NOT NULL,
  skeleton STRING(MAX) NOT NULL,
  tenant_id STRING(36) NOT NULL,
  unicode_version STRING(32) NOT NULL,
  icu_version STRING(32) NOT NULL,
  first_claimed_at INT64 NOT NULL,
  last_claimed_at INT64 NOT NULL
) PRIMARY KEY (canonical_name))",
    R"(CREATE TABLE idempotency (
  tenant_id STRING(36) NOT NULL,
  key_hash STRING(8) NOT NULL,
  idem_key STRING(MAX) NOT NULL,
  fingerprint STRING(MAX) NOT NULL,
  status INT64 NOT NULL,
  body STRING(MAX) NOT NULL,
  retry_after INT64,
  created_at INT64 NOT NULL,
  expires_at INT64 NOT NULL
) PRIMARY KEY (tenant_id, key_hash, idem_key))",
    R"(CREATE TABLE audit_events (
  tenant_id STRING(36) NOT NULL,
  bucket STRING(8) NOT NULL,
  event_id STRING(36) NOT NULL,
  event_type STRING(32) NOT NULL,
  redacted_name_hash STRING(64) NOT NULL,
  redacted_memory_hash STRING(64) NOT NULL,
  fencing_token INT64,
  created_at INT64 NOT NULL,
  renewals INT64
) PRIMARY KEY (tenant_id, bucket, event_id))",
    R"(CREATE TABLE settings (
  key STRING(MAX) NOT NULL,
  value STRING(MAX) NOT NULL
) PRIMARY KEY (key))",
    R"(CREATE TABLE waiters (
  waiter_id INT64 NOT NULL,
  tenant_id STRING(36) NOT NULL,
  canonical_name STRING(MAX) NOT NULL,
  skeleton STRING(MAX) NOT NULL,
  memory_id STRING(36) NOT NULL,
  alive_until INT64 NOT NULL,
  abandoned BOOL NOT NULL,
  entered_at TIMESTAMP NOT NULL OPTIONS (allow_commit_timestamp = true)
) PRIMARY KEY (waiter_id))",
    "CREATE INDEX waiters_by_skeleton ON waiters(skeleton)",
    "CREATE INDEX waiters_by_memory ON waiters(memory_id)",
    R"(CREATE TABLE lease_frees (
  free_id STRING(36) NOT NULL,
  canonical_name STRING(MAX) NOT NULL,
  memory_id STRING(36) NOT NULL,
  freed_at TIMESTAMP NOT NULL OPTIONS (allow_commit_timestamp = true)
) PRIMARY KEY (free_id))",
    R"(CREATE TABLE migration_rows (
  legacy_id STRING(MAX) NOT NULL,
  tenant_id STRING(36) NOT NULL,
  display_name STRING(MAX) NOT NULL,
  canonical_name STRING(MAX) NOT NULL,
  skeleton STRING(MAX) NOT NULL,
  action STRING(MAX) NOT NULL,
  reason STRING(MAX),
  memory_instance_id STRING(36) NOT NULL,
  legacy_memory_ref STRING(MAX) NOT NULL,
  legacy_created_at STRING(MAX) NOT NULL,
  migrated_at INT64 NOT NULL
) PRIMARY KEY (legacy_id))",
    "CREATE UNIQUE INDEX migration_rows_by_name ON migration_rows(canonical_name)",
    "CREATE UNIQUE INDEX migration_rows_by_skeleton ON migration_rows(skeleton)",
    R"(CREATE TABLE migration_identity_map (
  tenant_id STRING(36) NOT NULL,
  legacy_memory_ref STRING(MAX) NOT NULL,
  memory_instance_id STRING(36) NOT NULL
) PRIMARY KEY (tenant_id, legacy_memory_ref))",
    R"(CREATE TABLE schema_version (
  version INT64 NOT NULL
) PRIMARY KEY (version))",
};

const std::vector<std::string>* const k_schemas[] = {&k_schema_v1};
constexpr int k_version = static_cast<int>(std::size(k_schemas));

// The table a CREATE TABLE statement of getDdl's answer creates ("" for another statement).
std::string table_of(const std::string& ddl) {
  constexpr std::string_view prefix = "CREATE TABLE ";
  if (ddl.rfind(prefix, 0) != 0) return {};
  std::string rest = ddl.substr(prefix.size());
  std::string name;
  for (char c : rest) {
    if (c == ' ' || c == '(' || c == '\n') break;
    if (c != '`') name.push_back(c);
  }
  return name;
}

} // namespace

int schema_version() { return k_version; }

void SpannerStore::migrate() {
  // Several servers may start together on an empty database: a schema change that fails
  // because another one made it meanwhile is looked at again, not taken for an error.
  for (int attempt = 0;; ++attempt) {
    auto ddl = m_rest->get_ddl();
    if (!ddl) {
      if (ddl.error().kind == Failure::not_found)
        throw std::runtime_error("the Spanner database " + m_rest->database() +
                                 " does not exist (create it first, e.g. gcloud spanner databases create)");
      throw std::runtime_error("cannot read the Spanner database's schema: " + ddl.error().describe());
    }
    std::vector<std::string> tables;
    for (const auto& st : *ddl)
      if (auto t = table_of(st); !t.empty()) tables.push_back(t);
    auto has = [&](std::string_view t) { return std::find(tables.begin(), tables.end(), t) != tables.end(); };
    std::int64_t version = 0;
    if (has("schema_version")) {
      std::string s = borrow_session();
      auto r = read_once(s, "SELECT MAX(version) FROM schema_version");
      return_session(std::move(s));
      if (!r) throw std::runtime_error("cannot read the schema version: " + r.error().describe());
      auto rows = rows_of(*r);
      if (!rows.empty() && !rows[0].is_null(0)) version = rows[0].int64(0);
      // A schema_version table with no row: another server's first schema change is under way.
      if (version == 0 && attempt < 50) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        continue;
      }
    } else {
      std::string found;
      for (std::string_view t : k_first_schema_tables)
        if (has(t)) found += (found.empty() ? "" : ", ") + std::string(t);
      for (std::string_view t : {"waiters", "lease_frees"})
        if (has(t)) found += (found.empty() ? "" : ", ") + std::string(t);
      refuse_foreign_tables(found);
    }
    refuse_newer_schema(version, k_version);
    if (version == k_version) return;
    bool raced = false;
    for (int v = static_cast<int>(version) + 1; v <= k_version; ++v) {
      log::info("spanner: applying schema version {}", v);
      auto r = m_rest->update_ddl(*k_schemas[v - 1], std::chrono::seconds(600));
      if (!r) {
        if (attempt < 5 && (r.error().kind == Failure::failed_precondition || r.error().kind == Failure::invalid ||
                            r.error().kind == Failure::already_exists || r.error().kind == Failure::aborted)) {
          raced = true; // another server applied it: look again
          break;
        }
        throw std::runtime_error("cannot change the Spanner schema: " + r.error().describe());
      }
      std::string s = borrow_session();
      Mutations m;
      m.write("insertOrUpdate", "schema_version", {"version"}, json::array{int64_value(v)});
      auto w = write_once(s, m);
      return_session(std::move(s));
      if (!w) throw std::runtime_error("cannot record the schema version: " + w.error().describe());
    }
    if (!raced) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(200 * (attempt + 1)));
  }
}

} // namespace mep::server::spanner
