// Random bytes from OpenSSL's CSPRNG.
#include "mep/random.hpp"

#include "mep/crypto.hpp"

#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace mep {

void random_bytes(void* out, std::size_t n) {
  if (RAND_bytes(static_cast<unsigned char*>(out), static_cast<int>(n)) != 1) {
    std::fputs("mep: fatal: no secure random source available\n", stderr);
    std::abort();
  }
}

namespace {
std::atomic<unsigned> g_fork_generation{0};
} // namespace

void random_bytes_pooled(void* out, std::size_t n) {
  struct Pool {
    unsigned char bytes[512];
    std::size_t used = sizeof bytes;
    unsigned generation = 0;
  };
  static const bool registered = [] {
    ::pthread_atfork(nullptr, nullptr, [] { g_fork_generation.fetch_add(1, std::memory_order_relaxed); });
    return true;
  }();
  (void)registered;
  thread_local Pool pool;
  unsigned generation = g_fork_generation.load(std::memory_order_relaxed);
  if (pool.generation != generation) {
    pool.used = sizeof pool.bytes; // bytes the parent may also hold: never used here
    pool.generation = generation;
  }
  auto* dst = static_cast<unsigned char*>(out);
  while (n > 0) {
    if (pool.used == sizeof pool.bytes) {
      random_bytes(pool.bytes, sizeof pool.bytes);
      pool.used = 0;
    }
    std::size_t take = std::min(n, sizeof pool.bytes - pool.used);
    std::memcpy(dst, pool.bytes + pool.used, take);
    OPENSSL_cleanse(pool.bytes + pool.used, take);
    pool.used += take;
    dst += take;
    n -= take;
  }
}

std::string random_hex(std::size_t bytes) {
  std::vector<unsigned char> buf(bytes);
  random_bytes(buf.data(), bytes);
  return hex_lower(buf.data(), buf.size());
}

} // namespace mep
