// What q4q8.cpp and bf16.cpp share: the tile shape, the instruction-set paths and the
// environment's cap on them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TS_X86 1
#else
#define TS_X86 0
#endif

namespace treespec_kernels {

constexpr int64_t QK = 32;  // inputs per group
constexpr int64_t TN = 16;  // output columns per tile

enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512VNNI = 2, AMX = 3 };

// TREESPEC_KERNEL_ISA=amx|avx512vnni|avx2|scalar caps the path; ATEN_CPU_CAPABILITY=avx2|default
// (torch's own switch, tests/test_cpu_kinds.py) caps it as on such a core.
inline int64_t cap_from_env() {
  int64_t cap = AMX;
  if (const char* e = std::getenv("TREESPEC_KERNEL_ISA")) {
    const std::string v(e);
    if (v == "avx512vnni") cap = AVX512VNNI;
    else if (v == "avx2") cap = AVX2;
    else if (v == "scalar" || v == "aten") cap = SCALAR;
  }
  if (const char* e = std::getenv("ATEN_CPU_CAPABILITY")) {
    const std::string v(e);
    if (v == "avx2") cap = std::min<int64_t>(cap, AVX2);
    else if (v == "default") cap = SCALAR;
  }
  return cap;
}

// Whether AVX512 F/BW/VL/DQ (and AVX512-BF16 where `bf16`) run here, the path not capped below
// AVX512 by the environment: the AVX512-only kernels ask this once each (attention.cpp,
// reduce.cpp, bf16.cpp).
inline bool avx512_runs(bool bf16) {
#if TS_X86
  __builtin_cpu_init();
  const bool base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return base && (!bf16 || __builtin_cpu_supports("avx512bf16")) && cap_from_env() >= AVX512VNNI;
#else
  (void)bf16;
  return false;
#endif
}

// M rows in as few blocks of at most `most` as there can be, as even as can be (17 rows in blocks of
// at most 8: 6, 6, 5); block b has rows(b) of them
struct EvenBlocks {
  int64_t count, base, more;
  EvenBlocks(int64_t M, int64_t most)
      : count((M + most - 1) / most), base(count ? M / count : 0), more(count ? M % count : 0) {}
  int64_t rows(int64_t b) const { return base + (b < more); }
};

// Tile t's rows 0..a.M-1 in EvenBlocks of at most 8, each through Block<rows>::run(a, t, first
// row): a block unpacks the tile once, and a block of few rows waits on its dot-product chains.
template <template <int> class Block, typename Args>
inline void row_blocks(const Args& a, int64_t t) {
  if (a.M <= 0) return;
  const EvenBlocks split(a.M, 8);
  for (int64_t b = 0, r = 0; b < split.count; ++b) {
    const int64_t rows = split.rows(b);
    switch (rows) {
      case 8: Block<8>::run(a, t, r); break;
      case 7: Block<7>::run(a, t, r); break;
      case 6: Block<6>::run(a, t, r); break;
      case 5: Block<5>::run(a, t, r); break;
      case 4: Block<4>::run(a, t, r); break;
      case 3: Block<3>::run(a, t, r); break;
      case 2: Block<2>::run(a, t, r); break;
      default: Block<1>::run(a, t, r); break;
    }
    r += rows;
  }
}

}  // namespace treespec_kernels
