// Metrics registry and Prometheus text rendering.
#include "mep/metrics.hpp"

#include <array>
#include <span>
#include <fmt/format.h>

namespace mep::server {
namespace {

constexpr std::array k_buckets = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0};
// Waits for a lease last up to 300 s (Prefer: wait).
constexpr std::array k_wait_buckets = {0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0};
// Leases are held from a second (a quick job) to days (an agent's session).
constexpr std::array k_hold_buckets = {1.0,    5.0,     15.0,    60.0,     300.0,   900.0,
                                       3600.0, 14400.0, 86400.0, 259200.0, 604800.0};

std::span<const double> buckets_for(std::string_view family) {
  if (family == "mep_lease_wait_seconds") return k_wait_buckets;
  if (family == "mep_lease_hold_seconds") return k_hold_buckets;
  return k_buckets;
}

// Who counts a family: the control plane, the data plane (mep store), or both.
enum class By { server, store, both };

struct Family {
  std::string_view name;
  std::string_view type;
  std::string_view help;
  By by = By::server;
};

constexpr Family k_families[] = {
    {"mep_lease_renewal_latency_seconds", "histogram", "Time to answer a renew request"},
    {"mep_fencing_rejections_total", "counter", "Requests rejected for a superseded fencing token", By::both},
    {"mep_idempotency_lookups_total", "counter", "Idempotency-Key lookups by result"},
    {"mep_claims_total", "counter", "Claim requests by outcome"},
    {"mep_leases_active", "gauge", "Unexpired leases"},
    {"mep_leases_active_by_tenant", "gauge",
     "Unexpired leases per tenant (the 20 tenants with the most; the rest as tenant=\"_other\")"},
    {"mep_lease_ends_total", "counter", "Leases ended, by cause (released, expired, revoked, taken_over, max_hold)"},
    {"mep_lease_hold_seconds", "histogram", "How long a lease was held by its owner when it ended"},
    {"mep_renewals_total", "counter",
     "Renewals (single and in batches) by outcome: renewed, or the problem's code (max_hold and revoked apart)"},
    {"mep_db_ready", "gauge", "1 when the database answered the last readiness check (at each scrape), else 0"},
    {"mep_http_request_duration_seconds", "histogram", "HTTP request duration by route and code", By::both},
    {"mep_db_transaction_retries_total", "counter", "Database transactions retried"},
    {"mep_clock_steps_total", "counter", "Wall-clock steps found of the database clock that decides lease expiry"},
    {"mep_rate_limited_total", "counter", "Requests refused by the rate limiter"},
    {"mep_auth_failures_total", "counter", "Requests refused for a missing, malformed, unknown or revoked token",
     By::both},
    // SQLite's group commit (zero on PostgreSQL): requests per commit is the ratio of the
    // two counters; the histogram is the COMMIT's time, its fsync included.
    {"mep_sqlite_commits_total", "counter", "SQLite group commits"},
    {"mep_sqlite_committed_requests_total", "counter", "Requests committed by SQLite group commits"},
    {"mep_sqlite_commit_duration_seconds", "histogram", "Time of one SQLite group COMMIT, fsync included"},
    {"mep_sqlite_renewals_from_memory_total", "counter",
     "Renewals answered from memory, without the SQLite writer (counted once a second)"},
    {"mep_sqlite_checkpoints_total", "counter",
     "SQLite WAL checkpoints, by who ran them (checkpointer: its own thread; writer: the commit thread)"},
    // PostgreSQL's claim batches (zero on SQLite): claims per batch is the ratio of the first two.
    {"mep_pg_claim_batches_total", "counter", "PostgreSQL calls that sent several claims in one transaction"},
    {"mep_pg_batched_claims_total", "counter", "Claims sent in PostgreSQL claim batches"},
    {"mep_pg_claim_batch_fallbacks_total", "counter", "PostgreSQL claim batches that failed and were sent one by one"},
    // The same for single renewals (renew-batch requests are a call each, not counted here).
    {"mep_pg_renew_batches_total", "counter", "PostgreSQL calls that sent several single renewals in one transaction"},
    {"mep_pg_batched_renewals_total", "counter", "Single renewals sent in PostgreSQL renewal batches"},
    {"mep_pg_renew_batch_fallbacks_total", "counter",
     "PostgreSQL renewal batches that failed and were sent one by one"},
    {"mep_pg_release_batches_total", "counter", "PostgreSQL calls that sent several releases in one transaction"},
    {"mep_pg_batched_releases_total", "counter", "Releases sent in PostgreSQL release batches"},
    {"mep_pg_release_batch_fallbacks_total", "counter",
     "PostgreSQL release batches that failed and were sent one by one"},
    {"mep_pg_queued_operations", "gauge",
     "PostgreSQL claims, single renewals and releases waiting for their lane, by kind (claim, renew, release)"},
    {"mep_pg_running_operations", "gauge", "PostgreSQL operations taken by a database worker and not yet answered"},
    {"mep_pg_extra_lanes_total", "counter",
     "PostgreSQL batch calls started beside a running one of their kind, by reason (full_batch, waited)"},
    {"mep_lease_waiters", "gauge", "Claims waiting for a held name or memory (Prefer: wait)"},
    // mep store (zero on the control plane).
    {"mep_store_bytes_written_total", "counter", "Bytes of objects mep store wrote (accepted PUTs)", By::store},
    {"mep_lease_wait_seconds", "histogram", "Time a waiting claim waited, by outcome"},
};

// Shortest text that reads back as the same double ("0.0005", "3", "1e-07").
std::string fmt_double(double v) { return fmt::format("{}", v); }

} // namespace

Metrics& Metrics::global() {
  // Never destroyed: threads that outlive main's locals (a wait queue's, a store's) may
  // still count while static destructors run.
  static Metrics* m = new Metrics;
  return *m;
}

std::string Metrics::key(std::string_view name, std::string_view labels) {
  std::string k(name);
  if (!labels.empty()) {
    k += '{';
    k += labels;
    k += '}';
  }
  return k;
}

void Metrics::inc(std::string_view name, std::string_view labels, double v) {
  std::string k = key(name, labels);
  std::lock_guard lock(m_mutex);
  m_values[k] += v;
}

void Metrics::set(std::string_view name, double v) {
  std::string k(name);
  std::lock_guard lock(m_mutex);
  m_values[k] = v;
}

void Metrics::set(std::string_view name, std::string_view labels, double v) {
  std::string k = key(name, labels);
  std::lock_guard lock(m_mutex);
  m_values[k] = v;
}

void Metrics::observe(std::string_view name, std::string_view labels, double seconds) {
  std::string k(name);
  k += '|';
  k += labels;
  const auto buckets = buckets_for(name);
  std::lock_guard lock(m_mutex);
  auto& h = m_histograms[k];
  if (h.counts.empty()) h.counts.assign(buckets.size(), 0);
  for (std::size_t i = 0; i < buckets.size(); ++i)
    if (seconds <= buckets[i]) {
      h.counts[i] += 1;
      break;
    }
  h.sum += seconds;
  h.count += 1;
}

void Metrics::replace(std::string_view name, const std::vector<std::pair<std::string, double>>& series) {
  std::lock_guard lock(m_mutex);
  for (auto it = m_values.lower_bound(name); it != m_values.end();) {
    const std::string& k = it->first;
    if (k.compare(0, name.size(), name) != 0) break;
    if (k.size() > name.size() && k[name.size()] == '{')
      it = m_values.erase(it);
    else
      ++it;
  }
  for (const auto& [labels, v] : series) m_values[key(name, labels)] = v;
}

double Metrics::value(std::string_view name, std::string_view labels) const {
  std::string k = key(name, labels);
  std::lock_guard lock(m_mutex);
  auto it = m_values.find(k);
  return it == m_values.end() ? 0 : it->second;
}

std::string Metrics::render(Exporter exporter) const {
  std::lock_guard lock(m_mutex);
  std::string out;
  for (const auto& f : k_families) {
    if (f.by != By::both && (f.by == By::store) != (exporter == Exporter::store)) continue;
    out += "# HELP ";
    out += f.name;
    out += ' ';
    out += f.help;
    out += "\n# TYPE ";
    out += f.name;
    out += ' ';
    out += f.type;
    out += '\n';
    if (f.type == "histogram") {
      const auto buckets = buckets_for(f.name);
      std::string prefix(f.name);
      prefix += '|';
      bool any = false;
      for (auto it = m_histograms.lower_bound(prefix);
           it != m_histograms.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
        any = true;
        std::string labels = it->first.substr(prefix.size());
        std::string sep = labels.empty() ? "" : ",";
        double cum = 0;
        for (std::size_t i = 0; i < buckets.size(); ++i) {
          cum += it->second.counts[i];
          out += std::string(f.name) + "_bucket{" + labels + sep + "le=\"" + fmt_double(buckets[i]) + "\"} " +
                 fmt_double(cum) + "\n";
        }
        out += std::string(f.name) + "_bucket{" + labels + sep + "le=\"+Inf\"} " + fmt_double(it->second.count) + "\n";
        std::string lb = labels.empty() ? "" : "{" + labels + "}";
        out += std::string(f.name) + "_sum" + lb + " " + fmt_double(it->second.sum) + "\n";
        out += std::string(f.name) + "_count" + lb + " " + fmt_double(it->second.count) + "\n";
      }
      if (!any) {
        for (double b : buckets) out += std::string(f.name) + "_bucket{le=\"" + fmt_double(b) + "\"} 0\n";
        out += std::string(f.name) + "_bucket{le=\"+Inf\"} 0\n";
        out += std::string(f.name) + "_sum 0\n" + std::string(f.name) + "_count 0\n";
      }
    } else {
      bool any = false;
      for (auto it = m_values.lower_bound(f.name); it != m_values.end(); ++it) {
        const std::string& k = it->first;
        if (k.compare(0, f.name.size(), f.name) != 0) break;
        if (k.size() > f.name.size() && k[f.name.size()] != '{') continue;
        any = true;
        out += k + " " + fmt_double(it->second) + "\n";
      }
      if (!any) out += std::string(f.name) + " 0\n";
    }
  }
  return out;
}

} // namespace mep::server
