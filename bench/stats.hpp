// Small statistics the benchmarks print: the median of rounds, and "median (min..max)".
#pragma once
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace mep::bench {

/// The median of `v` (the upper one of an even count); 0 when empty.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// "1207 (1175..1423)": the median of `v` and its range, with `decimals` digits after the
/// point (whole numbers by default); "-" when empty.
inline std::string median_range(const std::vector<double>& v, int decimals = 0) {
  if (v.empty()) return "-";
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.*f (%.*f..%.*f)", decimals, median(v), decimals,
                *std::min_element(v.begin(), v.end()), decimals, *std::max_element(v.begin(), v.end()));
  return buf;
}

} // namespace mep::bench
