// The legacy migration.
//
// Design notes. A run has two phases. Phase 1 reads every legacy row, canonicalizes its
// name and groups rows by skeleton; in each group the oldest created_at keeps its name
// (ties: the smallest legacy id) — this is deterministic, so a resumed run picks the same
// winners. Phase 2 writes the rows in order, in transactions of --batch rows: rows already
// in migration_rows (an earlier, interrupted run) are skipped, so every legacy row ends up
// there exactly once and a second complete run changes nothing. Losers get
// `<canonical>-<suffix>`, the suffix being the random tail of a fresh UUIDv7's hex, as
// long as fits in 64 code points, checked for uniqueness of name and skeleton against
// every name of the migration. The enforcement flag (settings.migration_state) is
// `in-progress` from the first write until `mep migrate activate` sets it `active`.
#include "mep/migrate.hpp"
#include "mep/migrate_rows.hpp"

#include "mep/canonical.hpp"
#include "mep/json.hpp"
#include "mep/crypto.hpp"
#include "mep/log.hpp"
#include "mep/pg.hpp"
#include "mep/pg_store.hpp"
#include "mep/problem.hpp"
#include "mep/random.hpp"
#include "mep/sqlite.hpp"
#include "mep/sqlite_store.hpp"
#include "mep/store.hpp"
#include "mep/time.hpp"
#include "mep/uuid.hpp"

#include <boost/json.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <deque>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <fstream>
#include <numeric>
#include <unistd.h>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace mep::server {
namespace {
using sqlite::Db;
using sqlite::Use;
using Clock = std::chrono::steady_clock;
using namespace migration;

// An open-addressing set of 64-bit hashes (8 bytes a slot): the uniqueness checks of a
// million names in a few MB. A false positive only makes a fresh suffix be drawn again;
// the UNIQUE constraints of migration_rows stay the final word.
class HashSet64 {
public:
  explicit HashSet64(std::size_t expected) {
    m_slots.assign(std::max<std::size_t>(64, std::bit_ceil(expected * 2 + 1)), 0);
  }
  bool contains(std::uint64_t h) const {
    h = h ? h : 1;
    for (std::size_t i = h & (m_slots.size() - 1);; i = (i + 1) & (m_slots.size() - 1)) {
      if (m_slots[i] == h) return true;
      if (m_slots[i] == 0) return false;
    }
  }
  void insert(std::uint64_t h) {
    h = h ? h : 1;
    if ((m_size + 1) * 2 > m_slots.size()) grow();
    for (std::size_t i = h & (m_slots.size() - 1);; i = (i + 1) & (m_slots.size() - 1)) {
      if (m_slots[i] == h) return;
      if (m_slots[i] == 0) {
        m_slots[i] = h;
        ++m_size;
        return;
      }
    }
  }

private:
  void grow() {
    std::vector<std::uint64_t> old;
    old.swap(m_slots);
    m_slots.assign(old.size() * 2, 0);
    m_size = 0;
    for (auto h : old)
      if (h) insert(h);
  }
  std::vector<std::uint64_t> m_slots;
  std::size_t m_size = 0;
};

std::uint64_t hash_of(std::string_view s) { return std::hash<std::string_view>{}(s); }

bool less_id(const std::string& a, const std::string& b) {
  bool na = !a.empty() && a.find_first_not_of("0123456789") == std::string::npos;
  bool nb = !b.empty() && b.find_first_not_of("0123456789") == std::string::npos;
  if (na && nb && a.size() != b.size()) return a.size() < b.size();
  return a < b;
}

// ---- progress --------------------------------------------------------------------------------

class Progress {
public:
  Progress(std::string what, std::size_t total) : m_what(std::move(what)), m_total(total), m_tty(::isatty(2)) {}
  void update(std::size_t done, bool final = false) {
    auto now = Clock::now();
    if (!final && now - m_last < std::chrono::milliseconds(m_tty ? 100 : 2000)) return;
    m_last = now;
    double secs = std::chrono::duration<double>(now - m_start).count();
    double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
    double eta = rate > 0 ? static_cast<double>(m_total - done) / rate : 0;
    int pct = m_total ? static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(m_total)) : 100;
    if (m_tty) {
      int filled = pct * 30 / 100;
      std::fprintf(stderr, "\r%s [%s%s] %3d%% %zu/%zu rows  %.0f rows/s  ETA %.0f s ", m_what.c_str(),
                   std::string(static_cast<std::size_t>(filled), '#').c_str(),
                   std::string(static_cast<std::size_t>(30 - filled), '-').c_str(), pct, done, m_total, rate, eta);
      if (final) std::fputc('\n', stderr);
    } else {
      std::fprintf(stderr, "mep migrate: %s %zu/%zu rows (%d%%), %.0f rows/s\n", m_what.c_str(), done, m_total, pct,
                   rate);
    }
  }

private:
  std::string m_what;
  std::size_t m_total;
  bool m_tty;
  Clock::time_point m_start = Clock::now();
  Clock::time_point m_last{};
};

} // namespace

namespace migration {
const char* action_name(Row::Action a) {
  switch (a) {
  case Row::kept:
    return "kept";
  case Row::renamed:
    return "renamed";
  case Row::generated:
    return "generated";
  case Row::done:
    return "done";
  }
  return "kept";
}
} // namespace migration

int migrate_run(const MigrateOptions& o) {
  if (o.input_file.has_value() == o.from_table.has_value()) {
    std::fprintf(stderr, "mep migrate: give exactly one of --input FILE or --from-table TABLE\n");
    return exit_code::usage;
  }
  if (o.batch == 0) {
    std::fprintf(stderr, "mep migrate: --batch must be at least 1\n");
    return exit_code::usage;
  }
  if (o.from_table && is_spanner(o.db_url)) { // refused before the database is touched
    std::fprintf(stderr, "mep migrate: --from-table is not supported on Spanner: export the table as JSON Lines or "
                         "CSV and give it with --input\n");
    return exit_code::usage;
  }
  try {
    // 1. Read the legacy rows and check them: from a file before the database is opened
    //    (an input that does not pass changes nothing, not even a database that did not
    //    exist). `by_id` indexes them by legacy id (hash → row).
    std::unordered_map<std::uint64_t, std::uint32_t> by_id;
    auto refused = [&](const Rows& rows) {
      if (o.from_table) // a file's rows were checked as they were read, with their lines
        for (const Row& r : rows)
          if (auto why = r.problem()) {
            std::fprintf(stderr, "mep migrate: table %s, the row with legacy_id '%s': %s\n", o.from_table->c_str(),
                         r.legacy_id.c_str(), why->c_str());
            return true;
          }
      by_id.reserve(rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        auto [it, fresh] = by_id.try_emplace(hash_of(rows[i].legacy_id), static_cast<std::uint32_t>(i));
        if (!fresh && rows[it->second].legacy_id == rows[i].legacy_id) {
          if (o.input_file)
            std::fprintf(stderr, "mep migrate: %s:%u: legacy_id %s appears twice (first on line %u)\n",
                         o.input_file->c_str(), rows[i].line, rows[i].legacy_id.c_str(), rows[it->second].line);
          else
            std::fprintf(stderr, "mep migrate: legacy_id %s appears twice in the table %s\n", rows[i].legacy_id.c_str(),
                         o.from_table->c_str());
          return true;
        }
      }
      if (rows.empty()) std::fprintf(stderr, "mep migrate: warning: the input holds no rows\n");
      return false;
    };
    std::optional<expected<Rows, std::string>> input;
    if (o.input_file) {
      input = read_file(*o.input_file);
      if (!*input) {
        std::fprintf(stderr, "mep migrate: %s\n", input->error().c_str());
        return exit_code::usage;
      }
      if (refused(**input)) return exit_code::usage;
    }
    // Open: a plan never writes (read-only on SQLite, and no schema is created).
    std::unique_ptr<Target> db = open_target(o.db_url, o.dry_run);
    bool has_tables = db && db->has_tables();
    if (!input) {
      input = db ? db->read_table(*o.from_table) : make_unexpected(std::string("the database does not exist"));
      if (!*input) {
        std::fprintf(stderr, "mep migrate: %s\n", input->error().c_str());
        return exit_code::usage;
      }
      if (refused(**input)) return exit_code::usage;
    }
    Rows& rows = **input;

    // 2. What earlier runs already wrote (resume), and every name in use.
    HashSet64 used_names(rows.size()), used_skeletons(rows.size());
    std::unordered_set<std::string> taken_skeletons;            // exact, from earlier runs
    std::unordered_map<std::uint64_t, std::uint32_t> ref_index; // legacy_memory_ref hash → row
    std::unordered_map<std::string, std::string> db_identity;   // refs mapped by earlier runs
    std::string tenant_id = db ? db->tenant_id(o.tenant) : std::string();
    if (has_tables) {
      db->each_migrated([&](Migrated&& m) {
        used_names.insert(hash_of(m.canonical));
        used_skeletons.insert(hash_of(m.skeleton));
        taken_skeletons.insert(m.skeleton);
        auto it = by_id.find(hash_of(m.legacy_id));
        if (it == by_id.end() || rows[it->second].legacy_id != m.legacy_id) return;
        Row& r = rows[it->second];
        r.canonical = std::move(m.canonical);
        r.skeleton = std::move(m.skeleton);
        r.done_as = m.action == "renamed" ? Row::renamed : m.action == "generated" ? Row::generated : Row::kept;
        r.reason_code = 0;
        for (int k = 0; k <= static_cast<int>(NameReason::invisible_character); ++k)
          if (m.reason == to_string(static_cast<NameReason>(k))) r.reason_code = static_cast<std::uint8_t>(k + 1);
        r.memory_id = *Uuid::parse(m.memory_id);
        r.has_memory = true;
        r.action = Row::done;
      });
      // Names claimed through a server: a legacy row may not take one, nor share its
      // skeleton.
      db->each_name([&](std::string canonical, std::string skeleton) {
        used_names.insert(hash_of(canonical));
        used_skeletons.insert(hash_of(skeleton));
        taken_skeletons.insert(std::move(skeleton));
      });
      // Only the references of rows still to write matter (a complete re-run loads none).
      HashSet64 pending_refs(rows.size());
      bool any_pending = false;
      for (const auto& r : rows)
        if (r.action != Row::done && !r.legacy_memory_ref.empty()) {
          pending_refs.insert(hash_of(r.legacy_memory_ref));
          any_pending = true;
        }
      if (any_pending) {
        db->each_identity(tenant_id, [&](std::string ref, std::string id) {
          if (pending_refs.contains(hash_of(ref))) db_identity.emplace(std::move(ref), std::move(id));
        });
      }
    }

    // 3. Canonicalize, then choose winners: sort by (skeleton, created_at, legacy id);
    //    the first of each run of equal skeletons keeps its name (deterministic).
    Progress prep("canonicalizing", rows.size());
    std::vector<std::uint32_t> order;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Row& r = rows[i];
      if (r.action == Row::done) continue;
      auto name = canonicalize(r.display_name);
      if (!name) {
        r.action = Row::generated;
        r.reason_code = static_cast<std::uint8_t>(static_cast<int>(name.error().reason) + 1);
        continue;
      }
      r.canonical = std::move(name->canonical_name);
      r.skeleton = std::move(name->skeleton);
      order.push_back(static_cast<std::uint32_t>(i));
      if (i % 4096 == 0) prep.update(i);
    }
    prep.update(rows.size(), true);
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      const Row& x = rows[a];
      const Row& y = rows[b];
      if (int c = x.skeleton.compare(y.skeleton)) return c < 0;
      if (x.created_ms != y.created_ms) return x.created_ms < y.created_ms;
      return less_id(x.legacy_id, y.legacy_id);
    });
    for (std::size_t k = 0; k < order.size(); ++k) {
      Row& r = rows[order[k]];
      bool first = k == 0 || rows[order[k - 1]].skeleton != r.skeleton;
      if (first && !taken_skeletons.count(r.skeleton)) {
        r.action = Row::kept;
        used_names.insert(hash_of(r.canonical));
        used_skeletons.insert(hash_of(r.skeleton));
      } else {
        r.action = Row::renamed;
      }
    }
    std::vector<std::uint32_t>().swap(order);
    taken_skeletons.clear();
    // Suffixed and generated names, unique in name and skeleton.
    std::function<std::pair<std::string, std::string>(const std::string&)> fresh_name_of;
    auto fresh_name = [&](const std::string& base) {
      int failures = 0;
      for (;;) {
        std::string hex = uuid_v7().to_hex();
        std::size_t base_cp = 0; // code points of `base` (UTF-8)
        for (unsigned char ch : base) base_cp += (ch & 0xC0) != 0x80;
        std::size_t room = k_max_name_code_points - 1;
        std::string stem = base;
        std::size_t suffix_len = std::min<std::size_t>(32, room > base_cp ? room - base_cp : 0);
        if (suffix_len < 8) {
          // Shorten the stem to leave 8 hex digits: cut at a code point boundary.
          std::size_t keep_cp = room - 8, cp = 0, cut = 0;
          for (; cut < stem.size(); ++cut) {
            if ((static_cast<unsigned char>(stem[cut]) & 0xC0) != 0x80) {
              if (cp == keep_cp) break;
              ++cp;
            }
          }
          stem.resize(cut);
          while (!stem.empty() && (stem.back() == '-' || stem.back() == '_')) stem.pop_back();
          suffix_len = 8;
        }
        std::string suffix = hex.substr(32 - suffix_len);
        std::string candidate = (stem.empty() ? std::string("agent") : stem) + "-" + suffix;
        auto n = canonicalize(candidate);
        if (!n && n.error().reason == NameReason::mixed_script) {
          // The hex letters are Latin: beside a stem in another script (Cyrillic, Greek, Han…)
          // they make a mixed-script name, which no draw can fix. Digits belong to every script.
          for (char& ch : suffix)
            ch = static_cast<char>('0' + (std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0' : ch - 'a'));
          candidate = (stem.empty() ? std::string("agent") : stem) + "-" + suffix;
          n = canonicalize(candidate);
        }
        if (!n && ++failures > 64 && base != "agent") return fresh_name_of("agent"); // never loop forever
        if (!n || used_names.contains(hash_of(n->canonical_name)) || used_skeletons.contains(hash_of(n->skeleton)))
          continue;
        used_names.insert(hash_of(n->canonical_name));
        used_skeletons.insert(hash_of(n->skeleton));
        return std::make_pair(n->canonical_name, n->skeleton);
      }
    };
    fresh_name_of = fresh_name;
    for (auto& r : rows) {
      if (r.action == Row::renamed)
        std::tie(r.canonical, r.skeleton) = fresh_name(r.canonical);
      else if (r.action == Row::generated)
        std::tie(r.canonical, r.skeleton) = fresh_name("agent");
    }
    // Memory ids: given, mapped by an earlier run or an earlier row, or minted (one per
    // legacy reference).
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Row& r = rows[i];
      if (r.action == Row::done || r.has_memory) continue;
      if (!r.legacy_memory_ref.empty()) {
        auto it = ref_index.find(hash_of(r.legacy_memory_ref));
        if (it != ref_index.end() && rows[it->second].legacy_memory_ref == r.legacy_memory_ref) {
          r.memory_id = rows[it->second].memory_id;
          r.has_memory = true;
          continue;
        }
      }
      if (auto d = db_identity.find(r.legacy_memory_ref); d != db_identity.end() && !r.legacy_memory_ref.empty()) {
        r.memory_id = *Uuid::parse(d->second);
      } else {
        r.memory_id = uuid_v7();
      }
      r.has_memory = true;
      if (!r.legacy_memory_ref.empty())
        ref_index.try_emplace(hash_of(r.legacy_memory_ref), static_cast<std::uint32_t>(i));
    }
    std::unordered_map<std::uint64_t, std::uint32_t>().swap(ref_index);
    std::unordered_map<std::uint64_t, std::uint32_t>().swap(by_id);

    // 4. The report's file is opened before anything is written: a report that cannot be
    //    written stops the run with the database as it was.
    std::FILE* report = nullptr;
    if (!o.report_file.empty())
      report = std::fopen(o.report_file.c_str(), "w");
    else if (o.dry_run && !o.json)
      report = stdout;
    if (!o.report_file.empty() && !report) {
      std::fprintf(stderr, "mep migrate: cannot write %s: %s (nothing was migrated)\n", o.report_file.c_str(),
                   std::strerror(errno));
      return exit_code::other;
    }
    struct CloseReport {
      std::FILE*& f;
      ~CloseReport() {
        if (f && f != stdout) std::fclose(f);
      }
    } close_report{report};

    // 5. Write (run) in batches, resumable; a plan writes nothing.
    std::size_t fresh = 0;
    for (const auto& r : rows) fresh += r.action != Row::done;
    if (!o.dry_run && fresh > 0) {
      if (tenant_id.empty()) tenant_id = db->ensure_tenant(o.tenant);
      if (tenant_id.empty()) throw std::runtime_error("could not create the tenant " + o.tenant);
      db->mark_in_progress();
      Progress prog("migrating", fresh);
      std::size_t written = 0;
      const std::string uv = unicode_version(), iv = icu_version();
      std::vector<const Row*> batch;
      batch.reserve(std::min(o.batch, fresh));
      for (const auto& r : rows) {
        if (r.action == Row::done) continue;
        batch.push_back(&r);
        if (batch.size() == o.batch) {
          db->write(tenant_id, batch, uv, iv); // one transaction
          written += batch.size();
          batch.clear();
          prog.update(written);
        }
      }
      if (!batch.empty()) db->write(tenant_id, batch, uv, iv);
      written += batch.size();
      prog.update(written, true);
    }

    // 6. The report (every legacy row) and the summary.
    std::size_t kept = 0, renamed = 0, generated = 0, resumed = 0;
    for (const auto& r : rows) {
      Row::Action a = r.action;
      if (a == Row::done) {
        ++resumed;
        a = r.done_as;
      }
      if (a == Row::kept)
        ++kept;
      else if (a == Row::renamed)
        ++renamed;
      else
        ++generated;
      if (!report) continue;
      boost::json::object line{{"legacy_id", r.legacy_id},
                               {"display_name", r.display_name},
                               {"canonical_name", r.canonical},
                               {"action", action_name(a)}};
      if (r.reason_code) line["reason"] = r.reason();
      line["memory_instance_id"] = r.memory_id.to_string();
      std::string text = json::dump(line) + "\n";
      std::fwrite(text.data(), 1, text.size(), report);
    }
    boost::json::object summary{{"rows", static_cast<std::int64_t>(rows.size())},
                                {"kept", static_cast<std::int64_t>(kept)},
                                {"renamed", static_cast<std::int64_t>(renamed)},
                                {"generated", static_cast<std::int64_t>(generated)},
                                {"already_migrated", static_cast<std::int64_t>(resumed)},
                                {"written", static_cast<std::int64_t>(o.dry_run ? 0 : fresh)},
                                {"dry_run", o.dry_run}};
    if (o.json)
      std::printf("%s\n", json::dump(summary).c_str());
    else
      std::fprintf(o.dry_run && o.report_file.empty() ? stderr : stdout,
                   "%s: %zu rows: %zu kept, %zu renamed, %zu generated (%zu already migrated, %zu written)\n",
                   o.dry_run ? "plan" : "migrated", rows.size(), kept, renamed, generated, resumed,
                   o.dry_run ? std::size_t{0} : fresh);
    return exit_code::ok;
  } catch (const RunInProgress&) {
    std::fprintf(stderr, "mep migrate: another 'mep migrate run' is writing to this database; nothing was done: "
                         "run again once it has finished (it resumes where that one ended)\n");
    return exit_code::held;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mep migrate: %s\n", e.what());
    return exit_code::other;
  }
}

} // namespace mep::server
