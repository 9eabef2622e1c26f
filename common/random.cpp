// Random bytes from OpenSSL's CSPRNG.
#include "mep/random.hpp"

#include <openssl/rand.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace mep {

void random_bytes(void* out, std::size_t n) {
  if (RAND_bytes(static_cast<unsigned char*>(out), static_cast<int>(n)) != 1) {
    std::fputs("mep: fatal: no secure random source available\n", stderr);
    std::abort();
  }
}

std::string random_hex(std::size_t bytes) {
  static constexpr char hex[] = "0123456789abcdef";
  std::vector<unsigned char> buf(bytes);
  random_bytes(buf.data(), bytes);
  std::string out;
  out.reserve(bytes * 2);
  for (auto b : buf) {
    out.push_back(hex[b >> 4]);
    out.push_back(hex[b & 0xF]);
  }
  return out;
}

} // namespace mep
