// File identity primitives: stat, xattr, content hash.
#include "mep/identity.hpp"

#include "mep/crypto.hpp"
#include "mep/uuid.hpp"

#include <openssl/evp.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

namespace mep::daemon {

std::optional<FileStat> stat_file(const std::filesystem::path& path) {
  struct statx st {};
  if (::statx(AT_FDCWD, path.c_str(), 0, STATX_BASIC_STATS | STATX_BTIME, &st) != 0) return std::nullopt;
  FileStat f{static_cast<std::uint64_t>(::makedev(st.stx_dev_major, st.stx_dev_minor)),
             static_cast<std::uint64_t>(st.stx_ino), static_cast<std::uint64_t>(st.stx_size), S_ISREG(st.stx_mode),
             std::nullopt};
  if ((st.stx_mask & STATX_BTIME) != 0)
    f.birth_ns = static_cast<std::int64_t>(st.stx_btime.tv_sec) * 1'000'000'000 + st.stx_btime.tv_nsec;
  return f;
}

std::optional<std::string> read_id_xattr(const std::filesystem::path& path) {
  char buf[64];
  ssize_t n = ::getxattr(path.c_str(), k_xattr_name, buf, sizeof buf);
  if (n <= 0) return std::nullopt;
  auto u = Uuid::parse(std::string_view(buf, static_cast<std::size_t>(n)));
  if (!u) return std::nullopt;
  return u->to_string();
}

bool write_id_xattr(const std::filesystem::path& path, const std::string& id) {
  return ::setxattr(path.c_str(), k_xattr_name, id.data(), id.size(), 0) == 0;
}

std::optional<std::string> file_sha256(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  char buf[1 << 16];
  ssize_t n;
  bool ok = true;
  while ((n = ::read(fd, buf, sizeof buf)) != 0) {
    if (n < 0) {
      ok = false;
      break;
    }
    EVP_DigestUpdate(ctx, buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  if (!ok) return std::nullopt;
  return hex_lower(md, len);
}

} // namespace mep::daemon
