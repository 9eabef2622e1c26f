// Prometheus metrics (SPEC §6.3): counters, gauges and histograms with text exposition.
// Labels never carry names, ids or paths — only routes, codes and outcomes.
#pragma once
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace mep::server {

class Metrics {
public:
  /// The process-wide registry.
  static Metrics& global();

  /// Adds `v` to counter `name` with the label set `labels` (`outcome="granted"`).
  void inc(std::string_view name, std::string_view labels = {}, double v = 1);
  /// Sets gauge `name` (with the label set `labels`).
  void set(std::string_view name, double v);
  void set(std::string_view name, std::string_view labels, double v);
  /// Replaces every series of gauge `name` with `series` (label set, value): for a gauge
  /// whose label values come and go (mep_leases_active_by_tenant).
  void replace(std::string_view name, const std::vector<std::pair<std::string, double>>& series);
  /// Records one observation (seconds) in histogram `name`.
  void observe(std::string_view name, std::string_view labels, double seconds);
  /// The current value of a counter or gauge (0 when never touched); for tests and logs.
  double value(std::string_view name, std::string_view labels = {}) const;

  /// Which binary exports: each renders the families it counts (a family the other one
  /// counts would only show zeros, such as mep_db_ready 0 on mep store).
  enum class Exporter { server, store };
  /// The text exposition format (version 0.0.4).
  std::string render(Exporter exporter = Exporter::server) const;

private:
  struct Histogram {
    std::vector<double> counts; // one per bucket, cumulative at render time
    double sum = 0;
    double count = 0;
  };
  static std::string key(std::string_view name, std::string_view labels);

  mutable std::mutex m_mutex;
  std::map<std::string, double, std::less<>> m_values;        // "name{labels}" -> value
  std::map<std::string, Histogram, std::less<>> m_histograms; // "name|labels" -> data
};

} // namespace mep::server
