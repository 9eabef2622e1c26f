// The identity of a .uai file (SPEC §7): the xattr user.mep.memory_instance_id, the
// file's (device, inode), and its content fingerprint (SHA-256).
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace mep::daemon {

inline constexpr const char* k_xattr_name = "user.mep.memory_instance_id";

struct FileStat {
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
  std::uint64_t size = 0;
  bool regular = false;
  /// When the file was created (ns since the epoch), where the filesystem records it. An
  /// inode number is reused once its file is deleted; a birth time tells the new file apart.
  std::optional<std::int64_t> birth_ns;
};

/// statx(2) of `path`; nullopt when it does not exist or cannot be read.
std::optional<FileStat> stat_file(const std::filesystem::path& path);
/// The id in the file's xattr, if present and a UUID.
std::optional<std::string> read_id_xattr(const std::filesystem::path& path);
/// Writes the xattr; false where the filesystem does not support user xattrs.
bool write_id_xattr(const std::filesystem::path& path, const std::string& id);
/// SHA-256 of the file's bytes (hex), or nullopt on a read error.
std::optional<std::string> file_sha256(const std::filesystem::path& path);

} // namespace mep::daemon
