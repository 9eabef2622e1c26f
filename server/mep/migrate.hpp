// `mep migrate` (SPEC §10): legacy agents and memories brought under the new rules —
// every display name canonicalized, skeleton collisions settled (oldest keeps the name),
// memory ids minted and an identity map published, then enforcement switched on.
#pragma once
#include "mep/expected.hpp"

#include <cstddef>
#include <istream>
#include <optional>
#include <string>

namespace mep::server {

struct MigrateOptions {
  std::string db_url;                    ///< sqlite:PATH
  std::optional<std::string> input_file; ///< JSON Lines or CSV
  std::optional<std::string> from_table; ///< a table in the control-plane database
  std::string report_file;               ///< JSON Lines, one object per legacy row
  std::string tenant = "default";        ///< the tenant the memories belong to
  std::size_t batch = 10000;             ///< rows per transaction
  bool dry_run = false;                  ///< plan: read only, write nothing to the database
  bool json = false;                     ///< summary as JSON on stdout
};

/// `plan` (dry_run) and `run`. Returns the exit code; errors are reported on stderr.
int migrate_run(const MigrateOptions& o);
/// Opens the lease endpoints (the enforcement flag).
int migrate_activate(const std::string& db_url, bool json);
/// Counts by action, identity-map size and the flag.
int migrate_status(const std::string& db_url, bool json);

/// Reads legacy rows (JSON Lines, or CSV with a header) as `mep migrate` does and returns how
/// many there are, or the message naming the first bad line (`label` names the input).
expected<std::size_t, std::string> read_legacy_rows(std::istream& in, const std::string& label);

} // namespace mep::server
