// Routings for the MoE tests (CPU and GPU): a pure function of (kind, seed, rank), so every rank
// can compute every other rank's routing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tests/common/test_util.h"

namespace mk {
namespace test {

enum class MoeRouting : int {
  kUniform = 0,     // distinct experts per token, uniform
  kZipf = 1,        // skewed towards a hot expert (repeats within a token possible)
  kLocal = 2,       // every expert on the token's own rank
  kSparse = 3,      // most slots -1
  kEmptyRanks = 4,  // odd ranks route no token (0 tokens); the others uniform
  kFull = 5,        // every token of a rank to the same k ranks (offset by the seed), all T
                    // tokens in use: those k send slots full, every piece of them carrying rows
};
constexpr int kMoeRoutings = 6;
inline const char* moe_routing_name(MoeRouting r) {
  switch (r) {
    case MoeRouting::kUniform: return "uniform";
    case MoeRouting::kZipf: return "zipf";
    case MoeRouting::kLocal: return "local";
    case MoeRouting::kSparse: return "sparse";
    case MoeRouting::kEmptyRanks: return "empty_ranks";
    case MoeRouting::kFull: return "full";
  }
  return "?";
}

// ids [T, k] (-1: none), weights [T, k], *n tokens in use (<= T).
inline void make_moe_routing(MoeRouting kind, uint64_t seed, int rank, int W, int E, int k, int64_t T,
                             std::vector<int32_t>* ids, std::vector<float>* w, int64_t* n) {
  const int El = E / W;
  ids->assign(size_t(T) * k, -1);
  w->assign(size_t(T) * k, 0.f);
  uint64_t h = mix(seed, 0x6d6f65ull + uint64_t(rank) * 7919 + uint64_t(kind) * 104729);
  auto next = [&]() {
    h = mix(h, 0x9e3779b97f4a7c15ull);
    return h;
  };
  auto unit = [&]() { return double(next() >> 11) / double(1ull << 53); };
  int64_t cnt = T - (int64_t(rank) * 3) % 5;
  if (cnt < 0) cnt = 0;
  if (kind == MoeRouting::kEmptyRanks && rank % 2 == 1) cnt = 0;
  if (kind == MoeRouting::kFull) cnt = T;
  const int full_off = int(seed % uint64_t(W));
  *n = cnt;
  for (int64_t t = 0; t < T; ++t) {
    for (int kk = 0; kk < k; ++kk) {
      int32_t e = -1;
      switch (kind) {
        case MoeRouting::kUniform:
        case MoeRouting::kEmptyRanks:
        case MoeRouting::kSparse: {
          if (kind == MoeRouting::kSparse && unit() < 0.6) break;
          for (int tries = 0; tries < 64; ++tries) {  // distinct within the token when possible
            e = int32_t(next() % uint64_t(E));
            bool dup = false;
            for (int j = 0; j < kk; ++j) dup |= (*ids)[t * k + j] == e;
            if (!dup) break;
          }
          break;
        }
        case MoeRouting::kZipf: {
          const double u = unit();
          e = int32_t(double(E) * u * u * u);  // density ~ e^(-2/3): expert 0 is hot
          if (e >= E) e = E - 1;
          break;
        }
        case MoeRouting::kLocal:
          e = kk < El ? int32_t(rank * El + (int64_t(kk) + t) % El) : -1;
          break;
        case MoeRouting::kFull:
          e = int32_t(((rank + 1 + full_off + kk) % W) * El + (t + kk / W) % El);
          break;
      }
      (*ids)[t * k + kk] = e;
      (*w)[t * k + kk] = float(unit() * 2.0 - 0.5);
    }
  }
}

// bf16 bits of x[rank][t][col]: finite values in about [-2, 2], a function of (seed, rank, t, col).
inline uint16_t moe_x_bits(uint64_t seed, int rank, int64_t t, int64_t col) {
  const uint64_t v = mix(mix(seed, uint64_t(rank) << 40 | uint64_t(t)), uint64_t(col));
  // sign, exponent 126..128 (|x| in [0.5, 4)), 7 mantissa bits
  const uint16_t sign = uint16_t((v & 1) << 15);
  const uint16_t expo = uint16_t(126 + (v >> 1) % 3);
  const uint16_t mant = uint16_t((v >> 8) & 0x7f);
  return uint16_t(sign | (expo << 7) | mant);
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace test
}  // namespace mk
