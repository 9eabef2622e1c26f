// mepd's lease keeper: the work on memory files (branch, identify, init, lineage, verify,
// sync, fetch); the design notes are in keeper.cpp.
#include "keeper_internal.hpp"

#include "mep/canonical.hpp"
#include "mep/client_process.hpp"
#include "mep/json.hpp"
#include "mep/lease/wire.hpp"
#include "mep/log.hpp"
#include "mep/sqlite.hpp"
#include "mep/uuid.hpp"

#include <boost/json.hpp>
#include <fmt/format.h>

#include <algorithm>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mep::daemon {
namespace fs = std::filesystem;
using Clock = SteadyClock;
using namespace keeper_detail;

// ---- branch, identify, init, lineage ---------------------------------------------------------------

namespace {

bool write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

// Copies `from` to the new file `to` with the peer's rights, as `cp` would: the source's
// mode within `mode` (the client's umask). Never blocks a worker: the source is opened
// O_NONBLOCK (a FIFO put in its place, or a file under another process's lease, is
// refused, not waited for). On failure nothing is left at `to`.
std::optional<Problem> copy_as_peer(const fs::path& from, const fs::path& to, mode_t mode) {
  auto failed = [](int err, const char* what) {
    if (err == EWOULDBLOCK) {
      Problem p(Code::unavailable, "another process holds a lease on the memory file (fcntl F_SETLEASE); try again");
      p.retry_after_s = 1;
      return p;
    }
    return Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                   fmt::format("{}: {}", what, std::strerror(err)));
  };
  const int in = open_as_peer(from.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
  if (in < 0) return failed(errno, "cannot read the memory file");
  struct stat st {};
  if (::fstat(in, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(in);
    return Problem(Code::invalid_request, "the memory file is no longer a regular file");
  }
  const int out = open_as_peer(to.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOCTTY, 0600);
  if (out < 0) {
    const int err = errno;
    ::close(in);
    if (err == EEXIST) return Problem(Code::invalid_request, "the new path already exists");
    return failed(err, "cannot create the new file");
  }
  {
    AsPeer as;
    ::fchmod(out, st.st_mode & 0666 & mode);
  }
  int err = 0;
  for (;;) {
    const ssize_t n = ::copy_file_range(in, nullptr, out, nullptr, 1 << 30, 0);
    if (n > 0) continue;
    if (n == 0) break;
    if (errno == EINTR) continue;
    if (errno != EXDEV && errno != ENOSYS && errno != EINVAL && errno != EOPNOTSUPP) {
      err = errno;
      break;
    }
    // No copy_file_range between these files: read and write.
    char buf[1 << 16];
    for (;;) {
      const ssize_t r = ::read(in, buf, sizeof buf);
      if (r == 0) break;
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 || !write_all(out, buf, static_cast<std::size_t>(r))) {
        err = errno;
        break;
      }
    }
    break;
  }
  ::close(in);
  if (err == 0 && ::fsync(out) != 0) err = errno;
  if (::close(out) != 0 && err == 0) err = errno;
  if (err != 0) {
    AsPeer as;
    ::unlink(to.c_str());
    return failed(err, "cannot copy the memory file");
  }
  return std::nullopt;
}

} // namespace

expected<BranchedFile, Problem> Keeper::branch(const fs::path& path, const fs::path& new_path, uid_t viewer,
                                               mode_t mode) {
  auto ident = m_resolver.resolve(path, false);
  if (!ident) return make_unexpected(std::move(ident.error()));
  bool lost = false;
  auto live = m_book.live_on_memory(ident->memory_id, lost);
  if (live && !may_act_on(viewer, live->uid)) { // another user's lease: as if there were none
    live.reset();
    lost = false;
  }
  if (!live && lost)
    return make_unexpected(Problem(Code::lease_expired, "the lease on the source was lost: attach it again to branch"));
  if (!live)
    return make_unexpected(
        Problem(Code::lease_not_found, "branching needs a live lease on the source: attach it first"));
  if (auto p = copy_as_peer(path, new_path, mode)) return make_unexpected(std::move(*p));
  std::error_code ec;
  const std::string id = uuid_v7().to_string();
  m_cp_requests++;
  auto r = m_cp->branch(lease::BranchRequest{ident->memory_id, live->fencing_token, id}, "branch-" + id);
  if (!r) {
    AsPeer as;
    fs::remove(new_path, ec);
    return make_unexpected(std::move(r.error()));
  }
  try {
    m_resolver.bind(id, new_path, false); // same bytes as the parent: no fingerprint, no ambiguity
  } catch (const std::exception& e) {
    g_state_health.failed("record a branch", e);
  }
  return BranchedFile{*r, new_path.string()};
}

expected<Identified, Problem> Keeper::identify(const fs::path& path) {
  auto ident = m_resolver.resolve(path, false);
  if (!ident) return make_unexpected(std::move(ident.error()));
  try {
    m_resolver.bind(ident->memory_id, path, false, ident->file.sha256, &ident->file);
  } catch (const std::exception& e) {
    g_state_health.failed("record a file", e);
  }
  Identified out{ident->memory_id, path.string(), std::nullopt, std::nullopt};
  m_cp_requests++;
  if (auto m = m_cp->memory(ident->memory_id)) {
    out.parent_memory_id = m->parent_memory_id;
    out.branched_at_token = m->branched_at_token;
  }
  return out;
}

expected<Initialized, Problem> Keeper::init(const fs::path& path, mode_t mode) {
  int fd, err = 0;
  {
    // Created where and as the peer could: the file is the peer's.
    fd = open_as_peer(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
    err = errno;
    AsPeer as;
    if (fd >= 0) ::fchmod(fd, mode); // the client's umask, not the daemon's
  }
  if (fd < 0)
    return make_unexpected(Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                                   err == EEXIST ? std::string("the file already exists")
                                                 : std::string("cannot create the file: ") + std::strerror(err)));
  ::close(fd);
  const std::string id = uuid_v7().to_string();
  if (auto p = register_memory(id)) {
    AsPeer as;
    ::unlink(path.c_str());
    return make_unexpected(std::move(*p));
  }
  try {
    m_resolver.bind(id, path, false);
  } catch (const std::exception& e) {
    g_state_health.failed("record a new file", e); // the xattr carries the id where supported
  }
  return Initialized{id, path.string()};
}

expected<lease::Lineage, Problem> Keeper::lineage(const std::optional<fs::path>& path, const std::string& given_id) {
  std::string id;
  if (path) {
    auto ident = m_resolver.resolve(*path, false);
    if (!ident) return make_unexpected(std::move(ident.error()));
    id = ident->memory_id;
  } else if (auto u = Uuid::parse(given_id)) {
    id = u->to_string();
  } else {
    return make_unexpected(Problem(Code::invalid_request, "id must be a memory id (UUID)"));
  }
  m_cp_requests++;
  return m_cp->lineage(id);
}

// ---- verify, sync, fetch ---------------------------------------------------------------------------

namespace {
// The lease under `name` when it is live at this moment by the local clock: 404 when there
// is none, 410 once it is lost or its local deadline has passed.
expected<Held, Problem> live_lease(const LeaseBook& book, const std::string& name,
                                   const std::optional<std::string>& lease_id, uid_t viewer) {
  auto h = book.get(name);
  if (!h || !may_act_on(viewer, h->uid)) return make_unexpected(not_yours());
  // The client's lease, not one granted under the name since (whose token may be equal:
  // tokens count per memory).
  if (lease_id && h->lease_id != *lease_id) return make_unexpected(not_that_lease());
  if (h->state == LeaseState::lost || Clock::now() >= h->local_deadline)
    return make_unexpected(
        Problem(Code::lease_expired, "the lease was lost (" +
                                         (h->lost_reason.empty() ? std::string("deadline") : h->lost_reason) +
                                         "): attach it again"));
  return *h;
}
} // namespace

expected<VerifiedLease, Problem> Keeper::verify(const std::string& display, const std::optional<std::string>& lease_id,
                                                uid_t viewer) {
  const std::string name = canonical_or(display);
  auto h = live_lease(m_book, name, lease_id, viewer);
  if (!h) return make_unexpected(std::move(h.error()));
  m_cp_requests++;
  auto r = m_cp->verify(lease::VerifyRequest{h->memory_id, h->fencing_token});
  if (!r) {
    if (r.error().code == Code::stale_fence || r.error().code == Code::lease_expired) {
      if (auto ended = m_book.lose(name, h->fencing_token, r.error().slug())) forget({*ended});
    }
    return make_unexpected(std::move(r.error()));
  }
  return VerifiedLease{h->canonical_name, h->memory_id, h->fencing_token, r->expires_at};
}

expected<ObjectResult, Problem> Keeper::sync(const std::string& display, const std::optional<std::string>& lease_id,
                                             uid_t viewer) {
  const std::string name = canonical_or(display);
  auto h = live_lease(m_book, name, lease_id, viewer);
  if (!h) return make_unexpected(std::move(h.error()));
  if (!m_dp)
    return make_unexpected(
        Problem(Code::store_not_configured, "this mepd has no data plane: start it with --store URL"));
  if (!h->fenced) {
    Problem p(Code::store_unavailable, "the data plane's fence has not been advanced to this lease's token yet");
    p.retry_after_s = 1;
    return make_unexpected(std::move(p));
  }
  int fd, err = 0;
  {
    // The bytes are read with the lease owner's rights, not the daemon's nor those of root
    // syncing another user's lease (the file may since have become a link to root's own
    // files); never a FIFO or a device (a FIFO would block a worker until someone writes).
    std::optional<OwnerScope> as_owner; // an owner an older mepd did not record: the peer's
    if (h->uid != static_cast<uid_t>(-1)) as_owner.emplace(*h);
    fd = open_as_peer(h->path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
    err = errno;
    struct stat st {};
    if (fd >= 0 && (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
      ::close(fd);
      return make_unexpected(Problem(Code::invalid_request, "the memory file is no longer a regular file"));
    }
  }
  if (fd < 0)
    return make_unexpected(Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                                   std::string("cannot read the memory file: ") + std::strerror(err)));
  struct stat st {};
  ::fstat(fd, &st);
  auto r = m_dp->put(h->memory_id, h->fencing_token, fd, static_cast<std::uint64_t>(st.st_size));
  // A file written while it was sent: what the store got may be a state the file never
  // had (its size at the start, bytes from before and after a write).
  struct stat after {};
  const bool changed = ::fstat(fd, &after) != 0 || after.st_size != st.st_size ||
                       after.st_mtim.tv_sec != st.st_mtim.tv_sec || after.st_mtim.tv_nsec != st.st_mtim.tv_nsec;
  ::close(fd);
  if (!r && r.error().code == Code::stale_fence) {
    // A newer holder's token reached the store: this lease is over, whatever the control
    // plane has said so far.
    if (auto ended = m_book.lose(name, h->fencing_token, "stale-fence")) forget({*ended});
    return make_unexpected(std::move(r.error()));
  }
  if (changed) {
    Problem p(Code::unavailable, "the memory file changed while it was being sent, so the object stored may be "
                                 "torn: sync again once it is not being written");
    p.retry_after_s = 1;
    return make_unexpected(std::move(p));
  }
  if (!r) return make_unexpected(std::move(r.error()));
  return ObjectResult{h->canonical_name, h->memory_id, {}, r->fencing_token, r->etag, r->size};
}

expected<ObjectResult, Problem> Keeper::fetch(const std::string& memory_id, const fs::path& path, mode_t mode) {
  if (!m_dp)
    return make_unexpected(
        Problem(Code::store_not_configured, "this mepd has no data plane: start it with --store URL"));
  auto id = Uuid::parse(memory_id);
  if (!id) return make_unexpected(Problem(Code::invalid_request, "memory_instance_id must be a UUID"));
  // All users of one daemon share its tenant, where a memory id is enough to read an object.
  try {
    if (auto p = m_resolver.foreign(id->to_string())) return make_unexpected(std::move(*p));
  } catch (const sqlite::Error& e) {
    return make_unexpected(state_unwritable(e));
  }
  std::error_code ec;
  // Every file call here runs as the peer: the new file is created where the peer may, and
  // belongs to it.
  int fd, err = 0;
  std::string tmpl = (path.parent_path() / ("." + path.filename().string() + ".mep-fetch-XXXXXX")).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  {
    AsPeer as;
    if (fs::exists(path, ec) || fs::is_symlink(path, ec))
      return make_unexpected(Problem(Code::invalid_request, "the path already exists: fetch writes a new file"));
    // Into a temporary file beside it, then linked into place (never replacing a file that
    // appeared meanwhile), so the path holds the whole object or nothing.
    fd = ::mkostemp(name.data(), O_CLOEXEC);
    err = errno;
    if (fd >= 0) ::fchmod(fd, mode);
  }
  if (fd < 0)
    return make_unexpected(Problem(err == EACCES || err == EPERM ? Code::forbidden : Code::invalid_request,
                                   std::string("cannot create the file: ") + std::strerror(err)));
  const fs::path tmp(name.data());
  auto r = m_dp->get(id->to_string(), fd);
  auto fail = [&](Problem p) {
    ::close(fd);
    AsPeer as;
    ::unlink(tmp.c_str());
    return make_unexpected(std::move(p));
  };
  if (!r) return fail(std::move(r.error()));
  if (::fsync(fd) != 0)
    return fail(Problem(Code::unavailable, std::string("cannot write the fetched file: ") + std::strerror(errno)));
  ::close(fd);
  fd = -1;
  {
    AsPeer as;
    if (::link(tmp.c_str(), path.c_str()) != 0) {
      err = errno;
      ::unlink(tmp.c_str());
      return make_unexpected(
          Problem(Code::invalid_request, err == EEXIST ? std::string("the path already exists")
                                                       : std::string("cannot create the file: ") + std::strerror(err)));
    }
    ::unlink(tmp.c_str());
  }
  try {
    m_resolver.bind(id->to_string(), path, true);
  } catch (const std::exception& e) {
    g_state_health.failed("record a fetched file", e); // the xattr carries the id where supported
  }
  return ObjectResult{{}, id->to_string(), path.string(), r->fencing_token, r->etag, r->size};
}

} // namespace mep::daemon
