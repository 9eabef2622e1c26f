// A memory file as `mep mcp` reads and writes it: slices of its text, and writes that are
// atomic (a reader sees the old bytes or the new, never half), durable before they return
// (the new file and its directory fsync'd), and fenced (the lease is checked once more right
// before the new bytes take the file's place, and a refusal leaves the file as it was).
#pragma once
#include "mep/expected.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace mep::mcp {

struct Slice {
  std::string bytes;                        ///< the slice (cut at UTF-8 character boundaries when text)
  std::uint64_t offset = 0;                 ///< where it starts
  std::uint64_t size = 0;                   ///< the whole file's size
  std::optional<std::uint64_t> next_offset; ///< where the rest starts, when there is more
};

enum class Encoding { text, base64 };

/// Reads up to `length` bytes from `offset`. As text, a slice starts and ends on character
/// boundaries (the offset moves forward to the next one, the end back) and must be valid
/// UTF-8; base64 takes the bytes as they are. Fails with a message a user can act on.
expected<Slice, std::string> read_slice(const std::filesystem::path& path, std::uint64_t offset, std::uint64_t length,
                                        Encoding encoding);

/// The whole file, at most `limit` bytes (longer fails).
expected<std::string, std::string> read_all(const std::filesystem::path& path, std::uint64_t limit);

enum class WriteMode { replace, append };

/// A refusal by the fence: why the write must not happen (nullopt: go ahead).
using Fence = std::function<std::optional<std::string>()>;

/// Writes `bytes` (replacing the content, or after it) through a new file in the same
/// directory, fsync'd, with the old file's mode and memory-id attribute, renamed over the
/// file once `fence` allows it, then the directory fsync'd. A symbolic link is followed (its
/// target is written). Returns the new size; on failure the file is as it was and no
/// temporary file is left (a full disk says so).
expected<std::uint64_t, std::string> write_atomically(const std::filesystem::path& path, std::string_view bytes,
                                                      WriteMode mode, const Fence& fence);

/// What identifies one version of a file cheaply (inode, size, change time): a change of any
/// is a change of the file.
struct Version {
  std::uint64_t ino = 0, size = 0;
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const Version&) const = default;
};
std::optional<Version> version_of(const std::filesystem::path& path);

/// RFC 4648 base64, with padding.
std::string base64(std::string_view bytes);

} // namespace mep::mcp
