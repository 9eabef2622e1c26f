// File identity primitives: stat, xattr, content hash.
#include "mep/identity.hpp"

#include "mep/crypto.hpp"
#include "mep/peer.hpp"
#include "mep/state_db.hpp"
#include "mep/uuid.hpp"

#include <openssl/evp.h>

#include <cerrno>
#include <climits>
#include <fmt/format.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

namespace mep::daemon {

namespace {

// statx of `path` relative to `dirfd` (AT_EMPTY_PATH with "": the file `dirfd` is).
std::optional<FileStat> statx_file(int dirfd, const char* path, int flags) {
  struct statx st {};
  if (::statx(dirfd, path, flags, STATX_BASIC_STATS | STATX_BTIME, &st) != 0) return std::nullopt;
  FileStat f{static_cast<std::uint64_t>(::makedev(st.stx_dev_major, st.stx_dev_minor)),
             static_cast<std::uint64_t>(st.stx_ino), static_cast<std::uint64_t>(st.stx_size), S_ISREG(st.stx_mode),
             std::nullopt};
  if ((st.stx_mask & STATX_BTIME) != 0)
    f.birth_ns = static_cast<std::int64_t>(st.stx_btime.tv_sec) * 1'000'000'000 + st.stx_btime.tv_nsec;
  return f;
}

// Content fingerprints stop here: a (sparse) file of terabytes must not keep a worker busy
// for hours. Larger files are matched by xattr and inode only.
constexpr std::uint64_t k_max_fingerprinted = 1ULL << 30;

std::optional<std::string> sha256_of_fd(int fd) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  char buf[1 << 16];
  ssize_t n;
  bool ok = true;
  while ((n = ::read(fd, buf, sizeof buf)) != 0) {
    if (n < 0) {
      if (errno == EINTR) continue;
      ok = false;
      break;
    }
    EVP_DigestUpdate(ctx, buf, static_cast<std::size_t>(n));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  if (!ok) return std::nullopt;
  return hex_lower(md, len);
}

// A regular file opened as the peer (no /proc magic link, never blocking on a FIFO), or -1.
int open_regular(const std::filesystem::path& p) {
  int fd = open_as_peer(p.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return -1;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

} // namespace

std::optional<FileStat> stat_file(const std::filesystem::path& path) { return statx_file(AT_FDCWD, path.c_str(), 0); }

// An inode number names the file it was recorded for only while that file exists: a file
// created later at the same number (the first one deleted) has another birth time, and is
// not that memory. Where the filesystem keeps no birth time, the inode number alone counts.
expected<Resolved, Problem> IdentityResolver::resolve(const std::filesystem::path& path, bool mint) {
  auto look = m_files.look(path, false);
  if (!look && path.native().size() >= PATH_MAX)
    return make_unexpected(
        Problem(Code::invalid_request, fmt::format("the path is {} bytes long; paths may have {} at most",
                                                   path.native().size(), PATH_MAX - 1)));
  if (!look || !look->stat.regular)
    return make_unexpected(Problem(Code::invalid_request, "no such regular file: create it with 'mep init PATH'"));
  Resolved r;
  r.file = std::move(*look);
  std::optional<std::string> id = r.file.id;
  if (!id) id = m_db.memory_by_inode(r.file.stat, acting_uid());
  if (!id && r.file.stat.size > 0) {
    if (auto hashed = m_files.look(path, true); hashed && (r.file.sha256 = hashed->sha256)) {
      auto found = m_db.memories_by_content(*r.file.sha256, acting_uid());
      if (found.size() == 1) id = found.front();
    }
  }
  if (id) {
    // An xattr can be copied or forged onto one's own file.
    if (auto p = foreign(*id)) return make_unexpected(std::move(*p));
    r.memory_id = *id;
    r.unregistered = !m_db.registered(*id);
    return r;
  }
  if (!mint)
    return make_unexpected(Problem(Code::memory_not_found,
                                   "this file has no memory identity yet (attach it, or create one with mep init)"));
  r.memory_id = uuid_v7().to_string();
  r.fresh = true;
  return r;
}

std::optional<Problem> IdentityResolver::foreign(const std::string& memory_id) {
  const uid_t uid = acting_uid();
  if (acts_for_all(uid) || !m_db.memory_of_other_user(memory_id, uid)) return std::nullopt;
  return Problem(Code::forbidden, "this memory belongs to another user of this host");
}

void IdentityResolver::bind(const std::string& memory_id, const std::filesystem::path& path, bool hash,
                            std::optional<std::string> sha256, const Files::Look* seen) {
  std::optional<Files::Look> look = seen ? std::optional<Files::Look>(*seen) : m_files.look(path, hash && !sha256);
  if (!look) return;
  if (look->id != memory_id) m_files.write_id(path, memory_id); // a read costs less than a write
  if (!sha256) sha256 = std::move(look->sha256);
  m_db.remember_file(memory_id, path.string(), look->stat, sha256, acting_uid());
}

// Each call opens the file as the peer (open_as_peer) and works on that descriptor: the
// kernel checks the peer's rights once, on the file itself, and /proc's magic links are
// refused. stat needs no read permission (O_PATH); the xattr and the content need it.
std::optional<FileStat> Files::stat(const std::filesystem::path& p) {
  int fd = open_as_peer(p.c_str(), O_PATH);
  if (fd < 0) return std::nullopt;
  auto st = statx_file(fd, "", AT_EMPTY_PATH);
  ::close(fd);
  return st;
}
bool Files::write_id(const std::filesystem::path& p, const std::string& id) {
  int fd = open_regular(p);
  if (fd < 0) return false;
  AsPeer as; // the xattr is written with the peer's rights on the file
  const bool ok = ::fsetxattr(fd, k_xattr_name, id.data(), id.size(), 0) == 0;
  ::close(fd);
  return ok;
}
std::optional<Files::Look> Files::look(const std::filesystem::path& p, bool hash) {
  int fd = open_as_peer(p.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) { // unreadable (or gone): what stat alone tells
    auto st = stat(p);
    if (!st) return std::nullopt;
    return Look{*st, std::nullopt, std::nullopt};
  }
  std::optional<Look> out;
  if (auto st = statx_file(fd, "", AT_EMPTY_PATH)) {
    out = Look{*st, std::nullopt, std::nullopt};
    if (st->regular) {
      char buf[64];
      ssize_t n;
      {
        AsPeer as; // reading an xattr is checked against the caller's rights, even on a descriptor
        n = ::fgetxattr(fd, k_xattr_name, buf, sizeof buf);
      }
      if (n > 0)
        if (auto u = Uuid::parse(std::string_view(buf, static_cast<std::size_t>(n)))) out->id = u->to_string();
      if (hash && st->size > 0 && st->size <= k_max_fingerprinted) out->sha256 = sha256_of_fd(fd);
    }
  }
  ::close(fd);
  return out;
}

} // namespace mep::daemon
