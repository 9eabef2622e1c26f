// Renewals answered from memory: see renewal_table.hpp and server/sqlite/store.cpp.
#include "mep/renewal_table.hpp"

#include "mep/crypto.hpp"
#include "mep/random.hpp"
#include "mep/uuid.hpp"

#include <algorithm>
#include <cstring>

namespace mep::server {

RenewalTable::RenewalTable() {
  static_assert(sizeof(Entry) <= 40, "a map node of 64 bytes holds a lease");
  random_bytes(m_key.data(), m_key.size());
}

RenewalTable::Tag RenewalTable::tag(std::string_view tenant_id, std::string_view canonical_name,
                                    std::string_view owner_client_id) const {
  // Each part with its length before it: no two triples hash the same input.
  std::string in;
  in.reserve(m_key.size() + 12 + tenant_id.size() + canonical_name.size() + owner_client_id.size());
  in.append(reinterpret_cast<const char*>(m_key.data()), m_key.size());
  for (std::string_view part : {tenant_id, canonical_name, owner_client_id}) {
    const auto n = static_cast<std::uint32_t>(part.size());
    in.append(reinterpret_cast<const char*>(&n), sizeof n);
    in.append(part);
  }
  const Sha256 digest = sha256(in);
  Tag t;
  std::memcpy(t.data(), digest.data(), t.size());
  return t;
}

std::size_t RenewalTable::KeyHash::operator()(const Key& k) const noexcept {
  std::uint64_t a = 0, b = 0;
  std::memcpy(&a, k.data(), 8);
  std::memcpy(&b, k.data() + 8, 8);
  return static_cast<std::size_t>(a ^ (b * 0x9E3779B97F4A7C15ull)); // v7 ids: time in a, randomness in b
}

// Only the canonical lower-case text, as the database holds it: anything else is the
// writer's to judge.
std::optional<RenewalTable::Key> RenewalTable::key_of(std::string_view memory_id) {
  if (memory_id.find_first_of("ABCDEF") != std::string_view::npos) return std::nullopt;
  auto u = Uuid::parse(memory_id);
  if (!u) return std::nullopt;
  return u->bytes;
}

std::optional<RenewalTable::Renewal> RenewalTable::renew(std::string_view memory_id, std::int64_t token, const Tag& who,
                                                         std::int64_t ttl_s, UnixMs now) {
  auto k = key_of(memory_id);
  if (!k) return std::nullopt;
  std::lock_guard lock(m_mutex);
  auto it = m_entries.find(*k);
  if (it == m_entries.end() || m_closed) return std::nullopt;
  Entry& e = it->second;
  if (e.fencing_token != token || e.who != who || e.ttl_s != ttl_s || e.expires_at <= now) return std::nullopt;
  // Past the hold limit (or a count that would not fit): the writer decides.
  if ((e.hold_s && now + ttl_s * 1000 > static_cast<UnixMs>(e.hold_s) * 1000) || e.count() == Entry::k_max_count)
    return std::nullopt;
  e.expires_at = std::max(e.expires_at, now + ttl_s * 1000);
  e.set_count(e.count() + 1);
  bool first = false;
  if (!e.pending()) {
    e.set_pending(true);
    first = m_pending.empty();
    m_pending.push_back(*k);
  }
  m_renewals.fetch_add(1, std::memory_order_relaxed);
  return Renewal{e.expires_at, first};
}

std::optional<RenewalTable::Lease> RenewalTable::find(std::string_view memory_id, std::int64_t token) const {
  auto k = key_of(memory_id);
  if (!k) return std::nullopt;
  std::lock_guard lock(m_mutex);
  auto it = m_entries.find(*k);
  if (it == m_entries.end() || it->second.fencing_token != token) return std::nullopt;
  return it->second.lease();
}

std::optional<RenewalTable::Lease> RenewalTable::take(std::string_view memory_id) {
  auto k = key_of(memory_id);
  if (!k) return std::nullopt;
  std::lock_guard lock(m_mutex);
  auto it = m_entries.find(*k);
  if (it == m_entries.end()) {
    m_log.push_back(Event{true, *k, std::nullopt}); // a lease staged before it is not published
    return std::nullopt;
  }
  const Entry e = it->second;
  m_entries.erase(it);
  m_log.push_back(Event{true, *k, e.lease()});
  return e.lease();
}

void RenewalTable::stage(std::string_view memory_id, const Lease& lease) {
  if (auto k = key_of(memory_id)) m_log.push_back(Event{false, *k, lease});
}

std::vector<RenewalTable::Pending> RenewalTable::drain() {
  std::vector<Pending> out;
  std::lock_guard lock(m_mutex);
  out.reserve(m_pending.size());
  for (const Key& k : m_pending) {
    auto it = m_entries.find(k);
    if (it == m_entries.end() || !it->second.pending()) continue;
    out.push_back(Pending{Uuid{k}.to_string(), it->second.lease()});
    m_drained.emplace_back(k, it->second.count());
    it->second.set_pending(false);
    it->second.set_count(0);
  }
  m_pending.clear();
  return out;
}

void RenewalTable::put_back(const Key& k, const Lease& lease) {
  auto [it, inserted] = m_entries.try_emplace(k, Entry{lease, false});
  if (!inserted && it->second.fencing_token == lease.fencing_token) {
    it->second.expires_at = std::max(it->second.expires_at, lease.expires_at);
    it->second.set_count(it->second.count() + lease.renewals);
  }
  if (!it->second.pending()) {
    it->second.set_pending(true);
    m_pending.push_back(k);
  }
}

void RenewalTable::undo_to(Mark m) {
  std::lock_guard lock(m_mutex);
  // Backwards, so a lease taken twice returns as it was first taken. It returns pending:
  // the write-back that came with the take was undone too.
  for (std::size_t i = m_log.size(); i > m; --i) {
    const Event& ev = m_log[i - 1];
    if (ev.take && ev.lease) put_back(ev.key, *ev.lease);
  }
  m_log.resize(std::min(m_log.size(), m));
}

void RenewalTable::committed() {
  m_drained.clear();
  if (m_log.empty()) return; // most commits: nothing taken or staged, no lock, no map
  // A lease staged, then taken by a later job of the transaction (released, say), is not
  // published; one taken, then staged (a renewal by the writer) is.
  std::unordered_map<Key, const Lease*, KeyHash> publish;
  for (const Event& ev : m_log) {
    if (ev.take)
      publish.erase(ev.key);
    else
      publish[ev.key] = &*ev.lease;
  }
  std::lock_guard lock(m_mutex);
  for (const auto& [k, lease] : publish) m_entries.insert_or_assign(k, Entry{*lease, false});
  m_log.clear();
}

void RenewalTable::rolled_back() {
  undo_to(0);
  std::lock_guard lock(m_mutex);
  for (const auto& [k, told] : m_drained) {
    auto it = m_entries.find(k);
    if (it == m_entries.end()) continue; // taken: put back pending by undo_to
    it->second.set_count(it->second.count() + told);
    if (it->second.pending()) continue;
    it->second.set_pending(true);
    m_pending.push_back(k);
  }
  m_drained.clear();
}

void RenewalTable::close() {
  std::lock_guard lock(m_mutex);
  m_closed = true;
}

std::size_t RenewalTable::size() const {
  std::lock_guard lock(m_mutex);
  return m_entries.size();
}

} // namespace mep::server
