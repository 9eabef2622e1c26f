// The renewal table's rules alone (renewal_table.hpp): what it renews from memory, and how
// what the writer takes and stages follows the writer's transaction.
#include "mep/renewal_table.hpp"

#include <catch2/catch.hpp>

#include <string>

using namespace mep;
using namespace mep::server;

namespace {

const std::string k_memory = "0190f3a2-7b1c-7d4e-8f00-0000000000aa";

RenewalTable::Lease lease_of(const RenewalTable& t, std::int64_t token, UnixMs expires, std::int64_t ttl = 30) {
  return {token, ttl, expires, t.tag("tenant", "name", "owner")};
}

} // namespace

TEST_CASE("the renewal table renews only the lease it holds, for its holder", "[renewals]") {
  RenewalTable t;
  const auto who = t.tag("tenant", "name", "owner");
  CHECK_FALSE(t.renew(k_memory, 7, who, 30, 1000)); // nothing here yet
  t.stage(k_memory, lease_of(t, 7, 5000));
  CHECK_FALSE(t.renew(k_memory, 7, who, 30, 1000)); // staged, not committed
  t.committed();

  auto r = t.renew(k_memory, 7, who, 30, 1000);
  REQUIRE(r);
  CHECK(r->expires_at == 31000); // max(5000, 1000 + 30 s)
  CHECK(r->first_pending);
  auto again = t.renew(k_memory, 7, who, 30, 1001);
  REQUIRE(again);
  CHECK_FALSE(again->first_pending); // the writer was woken once

  CHECK_FALSE(t.renew(k_memory, 6, who, 30, 1000));                               // another token
  CHECK_FALSE(t.renew(k_memory, 7, t.tag("tenant", "name", "other"), 30, 1000));  // another owner
  CHECK_FALSE(t.renew(k_memory, 7, t.tag("tenant", "other", "owner"), 30, 1000)); // another name
  CHECK_FALSE(t.renew(k_memory, 7, t.tag("other", "name", "owner"), 30, 1000));   // another tenant
  CHECK_FALSE(t.renew(k_memory, 7, who, 60, 1000));                               // another TTL: the writer's
  CHECK_FALSE(t.renew("0190F3A2-7B1C-7D4E-8F00-0000000000AA", 7, who, 30, 1000)); // not the stored text
  CHECK_FALSE(t.renew(k_memory, 7, who, 30, 31001));                              // expired
  // Tags part their fields: ("ab", "c") is not ("a", "bc").
  CHECK(t.tag("t", "ab", "c") != t.tag("t", "a", "bc"));

  auto pending = t.drain();
  REQUIRE(pending.size() == 1);
  CHECK(pending[0].memory_id == k_memory);
  CHECK(pending[0].lease.expires_at == 31001);
  CHECK(t.drain().empty());
  t.committed();

  t.close();
  CHECK_FALSE(t.renew(k_memory, 7, who, 30, 2000));
}

TEST_CASE("what the writer takes leaves the table, and comes back if its transaction rolls back", "[renewals]") {
  RenewalTable t;
  const auto who = t.tag("tenant", "name", "owner");
  t.stage(k_memory, lease_of(t, 7, 5000));
  t.committed();

  // Taken with nothing pending: handed over all the same.
  auto taken = t.take(k_memory);
  REQUIRE(taken);
  CHECK(taken->expires_at == 5000);
  CHECK_FALSE(t.renew(k_memory, 7, who, 30, 1000)); // the writer's now
  t.rolled_back();
  // Back, pending (the write that came with the take was undone too).
  REQUIRE(t.renew(k_memory, 7, who, 30, 1000));
  REQUIRE(t.drain().size() == 1);

  // A renewal, then a take: the take hands the expiry over.
  REQUIRE(t.renew(k_memory, 7, who, 30, 2000));
  auto kept = t.take(k_memory);
  REQUIRE(kept);
  CHECK(kept->expires_at == 32000);
  t.committed();
  CHECK_FALSE(t.renew(k_memory, 7, who, 30, 2500)); // gone for good
  CHECK(t.size() == 0);

  // A job's savepoint rolled back: only what came after its mark returns.
  t.stage(k_memory, lease_of(t, 8, 40000));
  t.committed();
  const auto mark = t.mark();
  CHECK(t.take(k_memory));
  CHECK_FALSE(t.take(k_memory)); // gone
  t.undo_to(mark);
  CHECK(t.renew(k_memory, 8, who, 30, 3000));

  // Drained renewals are pending again after a rollback.
  REQUIRE(t.drain().size() == 1);
  t.rolled_back();
  CHECK(t.drain().size() == 1);
  t.committed();
}

TEST_CASE("a lease staged and then taken in one transaction is not published", "[renewals]") {
  RenewalTable t;
  const auto who = t.tag("tenant", "name", "owner");
  // Renewed by the writer, then released by a later job of the same batch.
  t.stage(k_memory, lease_of(t, 7, 5000));
  CHECK_FALSE(t.take(k_memory)); // not here yet
  t.committed();
  CHECK_FALSE(t.renew(k_memory, 7, who, 30, 1000));
  // Taken, then staged (op_renew takes, then stages): published.
  t.take(k_memory);
  t.stage(k_memory, lease_of(t, 7, 5000));
  t.committed();
  CHECK(t.renew(k_memory, 7, who, 30, 1000));
}
