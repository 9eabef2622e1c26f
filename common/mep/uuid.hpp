// UUIDs: parsing, formatting and the RFC 9562 version 7 generator.
#pragma once
#include <array>
#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace mep {

/// A 128-bit UUID in network byte order.
struct Uuid {
  std::array<std::uint8_t, 16> bytes{};

  /// Parses the canonical 8-4-4-4-12 hex form (either case); nullopt on anything else.
  static std::optional<Uuid> parse(std::string_view text);
  /// The canonical lower-case 36-character form.
  std::string to_string() const;
  /// The 32 hex digits without dashes.
  std::string to_hex() const;
  /// The version nibble (7 for UUIDv7).
  int version() const { return bytes[6] >> 4; }
  /// True when the variant bits are RFC 9562's 0b10.
  bool rfc_variant() const { return (bytes[8] & 0xC0) == 0x80; }
  /// The 48-bit Unix millisecond timestamp of a UUIDv7.
  std::uint64_t unix_ms() const;
  bool is_nil() const;

  auto operator<=>(const Uuid&) const = default;
};

/// A fresh UUIDv7: 48-bit Unix ms timestamp, version 7, variant 0b10, 74 random bits.
/// Strictly increasing within the process, even inside one millisecond and across
/// threads (RFC 9562 §6.2 method 2: the random part is a counter within a millisecond).
Uuid uuid_v7();

/// True when `text` parses as a UUID whose version is 7 and whose variant is RFC 9562's.
bool is_uuid_v7(std::string_view text);

} // namespace mep
