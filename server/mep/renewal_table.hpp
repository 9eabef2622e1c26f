// Renewals answered from memory, for the SQLite store (see "Renewals from memory" in
// server/sqlite/store.cpp): the leases the writer has handed over, the expiries renewals gave
// them since, and which of those the database has yet to be told.
//
// The rule that keeps it safe: a lease is either here or the writer's. A renewal is
// answered here only while the lease is here; before the writer reads a lease row it
// takes the lease out (take), so no renewal from memory lands after the writer has
// looked, and the writer writes back what it took. Taken and staged changes follow the
// writer's transaction: undone when it rolls back, published when it commits.
#pragma once
#include "mep/time.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mep::server {

class RenewalTable {
public:
  /// Who may renew a lease: a keyed hash of its tenant, name and owner. The key is drawn
  /// per process and never leaves it, so no caller can make another's tag.
  using Tag = std::array<std::uint8_t, 16>;

  struct Lease {
    std::int64_t fencing_token = 0;
    std::int64_t ttl_s = 0; // as on disk: a renewal with another TTL goes to the writer
    UnixMs expires_at = 0;
    Tag who{};
    /// The lease's hold limit (max hold): a renewal that would carry it past goes to the
    /// writer, which refuses it. Kept to the second below, so never later than the limit.
    std::optional<UnixMs> hold_until = std::nullopt;
    /// Renewals answered here that the database has not counted yet.
    std::int64_t renewals = 0;
  };
  /// A lease as the database must be told (memory_id: the canonical text).
  struct Pending {
    std::string memory_id;
    Lease lease;
  };

  RenewalTable();

  Tag tag(std::string_view tenant_id, std::string_view canonical_name, std::string_view owner_client_id) const;

  struct Renewal {
    UnixMs expires_at;
    bool first_pending; // the database had been told everything before it: wake the writer
  };
  /// Any thread. Renews the lease of `memory_id` when it is here, is `token`'s, is `who`'s,
  /// has `ttl_s` as its TTL, is unexpired at `now` and stays within its hold limit:
  /// expiry = max(old, now + ttl).
  /// nullopt: the writer decides (and answers with the right problem, if any).
  std::optional<Renewal> renew(std::string_view memory_id, std::int64_t token, const Tag& who, std::int64_t ttl_s,
                               UnixMs now);
  /// Any thread: the lease of `memory_id` under `token`, if here (readers' view of the
  /// renewals the database has not been told yet).
  std::optional<Lease> find(std::string_view memory_id, std::int64_t token) const;

  // ---- the writer thread only ----
  /// Takes the lease of `memory_id` out and returns it, if here: the writer gives the row
  /// its expiry when that is later (a renewal from memory the database was not told).
  std::optional<Lease> take(std::string_view memory_id);
  /// The lease will be here, as `lease`, once the open transaction commits.
  void stage(std::string_view memory_id, const Lease& lease);
  /// What the database has not been told, marked told; kept until the transaction ends.
  std::vector<Pending> drain();
  /// A point in the open transaction (a job's savepoint), and the undo back to it.
  using Mark = std::size_t;
  Mark mark() const { return m_log.size(); }
  void undo_to(Mark m);
  /// The transaction committed: staged leases are published.
  void committed();
  /// The transaction rolled back: taken leases return, drained ones are pending again.
  void rolled_back();

  /// No renewal is answered here after this (the store stops).
  void close();

  std::size_t size() const;
  /// Renewals answered here since the start.
  std::uint64_t renewals() const { return m_renewals.load(std::memory_order_relaxed); }

private:
  using Key = std::array<std::uint8_t, 16>;
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept;
  };
  // 40 bytes (a Lease and a flag would take 48): 100,000 leases held here cost about
  // 6.4 MiB in the map's nodes.
  struct Entry {
    static constexpr std::uint16_t k_pending = 0x8000; // in `bits`; the rest counts renewals
    static constexpr std::uint16_t k_max_count = 0x7FFF;
    Entry(const Lease& l, bool p)
        : fencing_token(l.fencing_token), expires_at(l.expires_at), who(l.who),
          hold_s(l.hold_until ? static_cast<std::uint32_t>(std::max<UnixMs>(1, *l.hold_until / 1000)) : 0),
          ttl_s(static_cast<std::uint16_t>(l.ttl_s)),
          bits(static_cast<std::uint16_t>((p ? k_pending : 0) | std::min<std::int64_t>(l.renewals, k_max_count))) {}
    Lease lease() const {
      return {fencing_token,
              ttl_s,
              expires_at,
              who,
              hold_s ? std::optional<UnixMs>(static_cast<UnixMs>(hold_s) * 1000) : std::nullopt,
              bits & k_max_count};
    }
    bool pending() const { return bits & k_pending; }
    void set_pending(bool p) { bits = static_cast<std::uint16_t>(p ? (bits | k_pending) : (bits & ~k_pending)); }
    std::int64_t count() const { return bits & k_max_count; }
    void set_count(std::int64_t n) {
      bits = static_cast<std::uint16_t>((bits & k_pending) | std::min<std::int64_t>(n, k_max_count));
    }
    std::int64_t fencing_token;
    UnixMs expires_at;
    Tag who;
    std::uint32_t hold_s; // the hold limit in whole seconds (rounded down); 0: none
    std::uint16_t ttl_s;  // TTLs are at most 300 s
    std::uint16_t bits;   // k_pending: renewed here since the database was last told; renewals not told
  };
  static std::optional<Key> key_of(std::string_view memory_id);
  void put_back(const Key& k, const Lease& lease); // under m_mutex

  std::array<std::uint8_t, 32> m_key{};
  mutable std::mutex m_mutex;
  std::unordered_map<Key, Entry, KeyHash> m_entries; // under m_mutex
  std::vector<Key> m_pending;                        // under m_mutex: may name entries no longer pending
  bool m_closed = false;                             // under m_mutex
  std::atomic<std::uint64_t> m_renewals{0};
  // The writer's, for the open transaction: takes and stages in order, and the drained.
  struct Event {
    bool take; // else a stage
    Key key;
    std::optional<Lease> lease; // a take's: what it took (nullopt: nothing was here)
  };
  std::vector<Event> m_log;
  std::vector<std::pair<Key, std::int64_t>> m_drained; // with the renewals they told
};

} // namespace mep::server
