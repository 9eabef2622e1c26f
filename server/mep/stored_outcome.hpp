// An outcome as an Idempotency-Key keeps it (SQLite's idempotency table): the status and
// the body the HTTP API answers, rendered by lease/wire.hpp, and the problem's Retry-After.
// A replay reads it back into the typed outcome, so the edge renders it as it rendered the
// first answer. The form is the one earlier versions stored, so their records replay too.
#pragma once
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/store.hpp"

#include <optional>
#include <string>

namespace mep::server {

struct StoredOutcome {
  int status = 0;
  std::string body;
  std::optional<int> retry_after_s;
};

namespace stored {
inline int status_of(const lease::Registered& r) { return r.created ? 201 : 200; }
inline int status_of(const lease::Branched& b) { return b.created ? 201 : 200; }
inline int status_of(const lease::Grant&) { return 201; }

inline expected<lease::Registered, Problem> decode(const boost::json::object& o, lease::Registered*) {
  return lease::wire::decode_registered(o);
}
inline expected<lease::Branched, Problem> decode(const boost::json::object& o, lease::Branched*) {
  return lease::wire::decode_branched(o);
}
inline expected<lease::Grant, Problem> decode(const boost::json::object& o, lease::Grant*) {
  return lease::wire::decode_grant(o);
}
} // namespace stored

/// The stored form of an outcome; a problem keeps `request_id` as its instance.
template <class T>
StoredOutcome store_outcome(const expected<T, Problem>& v, const std::string& request_id) {
  StoredOutcome s;
  if (v) {
    s.status = stored::status_of(*v);
    s.body = json::dump(lease::wire::to_json(*v));
  } else {
    Problem p = v.error();
    p.instance = request_id;
    s.status = p.status();
    s.body = json::dump(p.to_json());
    s.retry_after_s = p.retry_after_s;
  }
  return s;
}

/// The outcome a stored record replays (`created` is false: a replay creates nothing).
/// A record that cannot be read is an internal error, not a crash.
template <class T>
Outcome<T> replay_outcome(const StoredOutcome& s) {
  auto o = json::parse_object(s.body);
  if (o && s.status >= 400) {
    Problem p = Problem::from_json(*o);
    p.retry_after_s = s.retry_after_s;
    return Outcome<T>(std::move(p), true);
  }
  if (o) {
    auto v = stored::decode(*o, static_cast<T*>(nullptr));
    if (v) return Outcome<T>(std::move(*v), true);
  }
  return Outcome<T>(Problem(Code::internal, "the outcome stored under this Idempotency-Key cannot be read"), true);
}

} // namespace mep::server
