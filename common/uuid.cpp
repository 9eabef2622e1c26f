// UUIDv7 generation (RFC 9562 §5.7, monotonic per §6.2) and UUID text forms.
#include "mep/uuid.hpp"

#include "mep/random.hpp"

#include <chrono>
#include <mutex>

namespace mep {
namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

constexpr char k_hex[] = "0123456789abcdef";

} // namespace

std::optional<Uuid> Uuid::parse(std::string_view text) {
  if (text.size() != 36) return std::nullopt;
  Uuid u;
  std::size_t byte = 0;
  for (std::size_t i = 0; i < 36;) {
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      if (text[i] != '-') return std::nullopt;
      ++i;
      continue;
    }
    int hi = hex_value(text[i]);
    int lo = hex_value(text[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    u.bytes[byte++] = static_cast<std::uint8_t>(hi << 4 | lo);
    i += 2;
  }
  return u;
}

std::string Uuid::to_string() const {
  std::string out;
  out.reserve(36);
  for (std::size_t i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    out.push_back(k_hex[bytes[i] >> 4]);
    out.push_back(k_hex[bytes[i] & 0xF]);
  }
  return out;
}

std::string Uuid::to_hex() const {
  std::string out;
  out.reserve(32);
  for (auto b : bytes) {
    out.push_back(k_hex[b >> 4]);
    out.push_back(k_hex[b & 0xF]);
  }
  return out;
}

std::uint64_t Uuid::unix_ms() const {
  std::uint64_t ms = 0;
  for (int i = 0; i < 6; ++i) ms = ms << 8 | bytes[i];
  return ms;
}

bool Uuid::is_nil() const {
  for (auto b : bytes)
    if (b) return false;
  return true;
}

bool is_uuid_v7(std::string_view text) {
  auto u = Uuid::parse(text);
  return u && u->version() == 7 && u->rfc_variant();
}

// Design note: the 74 bits after the timestamp (12 of rand_a, 62 of rand_b) are read
// as one counter. A new millisecond starts it at a random value with its top bit clear
// (so at least 2^73 increments fit); within the same millisecond it is incremented by
// a random step of 1..2^16. If the clock goes backwards or the counter would overflow,
// the previous timestamp is kept (or advanced by one) so ids never go down.
Uuid uuid_v7() {
  static std::mutex mutex;
  static std::uint64_t last_ms = 0;
  static std::uint64_t counter_hi = 0; // top 10 bits of the 74-bit counter
  static std::uint64_t counter_lo = 0; // low 64 bits

  std::uint64_t now_ms = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  std::uint64_t rnd[2];
  random_bytes_pooled(rnd, sizeof rnd);

  std::uint64_t ms, hi, lo;
  {
    std::lock_guard lock(mutex);
    if (now_ms > last_ms) {
      last_ms = now_ms;
      counter_hi = rnd[0] & 0x1FF; // 9 bits: top bit of the 10 stays clear
      counter_lo = rnd[1];
    } else {
      std::uint64_t step = (rnd[0] >> 16 & 0xFFFF) + 1;
      std::uint64_t before = counter_lo;
      counter_lo += step;
      if (counter_lo < before) ++counter_hi;
      if (counter_hi > 0x3FF) { // exhausted: move to the next millisecond
        ++last_ms;
        counter_hi = rnd[0] & 0x1FF;
        counter_lo = rnd[1];
      }
    }
    ms = last_ms;
    hi = counter_hi;
    lo = counter_lo;
  }

  // Layout: 48 bits ms | 4 bits version | 12 bits rand_a | 2 bits variant | 62 bits rand_b.
  // rand_a = counter bits 73..62, rand_b = counter bits 61..0.
  std::uint64_t rand_a = (hi << 2 | lo >> 62) & 0xFFF;
  std::uint64_t rand_b = lo & 0x3FFFFFFFFFFFFFFFULL;
  Uuid u;
  for (int i = 0; i < 6; ++i) u.bytes[i] = static_cast<std::uint8_t>(ms >> (40 - 8 * i));
  u.bytes[6] = static_cast<std::uint8_t>(0x70 | rand_a >> 8);
  u.bytes[7] = static_cast<std::uint8_t>(rand_a);
  u.bytes[8] = static_cast<std::uint8_t>(0x80 | rand_b >> 56);
  for (int i = 9; i < 16; ++i) u.bytes[i] = static_cast<std::uint8_t>(rand_b >> (8 * (15 - i)));
  return u;
}

} // namespace mep
