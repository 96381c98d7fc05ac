// treespec::q4q8_linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in 4 bits (GGUF Q4_0 / Q4_1
// blocks: per output row and group of 32 inputs, w = d q + m, q in 0..15), x quantized per row and
// group of 32 to int8 (Q8_1-style: q_a = rne(x * (127 / amax)), s = amax / 127, S = s * sum(q_a)).
//
//   y[r, o] = sum over groups g, in order, of  dot_g(q_w, q_a) * (d[o,g] s[r,g])  +  m[o,g] S[r,g]
//
// computed as acc = fma(float(dot), d * s, acc); acc = fma(m, S, acc) for g = 0, 1, ..., then
// y = acc + bias. The integer dot products are exact, so every path (AVX512-VNNI, AVX2, scalar)
// gives the same bits, and a row's result never depends on the other rows of the call: rows are
// quantized alone, and parallelism is over output tiles only (never K or M).
//
// Weight layout (pack_q4 in q4q8.py): tiles of 16 output columns; per tile and group 320 bytes:
//   bytes [64p, 64p + 64), p = 0..3: column j at bytes 4j..4j+3, low nibbles = q[j, 8p + b],
//     high nibbles = q[j, 8p + 4 + b] (b = 0..3): one zmm = two VPDPBUSD operands of 16 lanes;
//   bytes [256, 288): d of the 16 columns (fp16); [288, 320): m (fp16). Padding columns are 0.
//
// treespec::q8q8_linear: the same with W in 8 bits (GGUF Q8_0: w = d q, q in -127..127, as GGUF
// files keep output layers), y[r, o] = sum over g of fma(float(dot_g(q_w, q_a)), d s, .) (+ bias).
// Layout (pack_q8): per tile and group 544 bytes: [64p, 64p + 64), p = 0..7: column j at bytes
// 4j..4j+3 = q[j, 4p + b] + 128 (unsigned, VPDPBUSD's first operand; the dot then subtracts
// 128 * sum(q_a), exactly); [512, 544): d (fp16).
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <vector>

#include "isa.h"

#if TS_X86 && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace treespec_kernels;

constexpr int64_t TILE_BYTES = 320;  // per tile and group, 4-bit weights
constexpr int64_t TILE8_BYTES = 544;  // per tile and group, 8-bit weights

struct Args {
  const int8_t* qa;   // [M, K] activations, int8
  const float* sa;    // [M, G] their scales
  const float* Sa;    // [M, G] scale * sum of the group's int8 values
  const int32_t* ia;  // [M, G] the sum of the group's int8 values
  const uint8_t* w;   // [T, G, 320] packed weights
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t M, N, K, G, T;
  int64_t prefetch_rows;  // blocks of at least this many rows prefetch the weights (q4q8_prefetch_rows)
};

// Blocks of at least this many rows prefetch the weights they stream (`prefetch_ahead`): 5 unless
// told (q4q8_prefetch_rows, which the Python side sets from a measurement once per machine).
std::atomic<int64_t> prefetch_min_rows{5};

int64_t q4q8_prefetch_rows(int64_t rows) {
  if (rows >= 1) prefetch_min_rows.store(rows);
  return prefetch_min_rows.load();
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// ---------------------------------------------------------------- scalar (any CPU)

// x float or c10::BFloat16 (read as float, exactly), rows of K
template <typename T>
void quantize_scalar(const T* x, int64_t M, int64_t K, int8_t* qa, float* sa, float* Sa, int32_t* ia) {
  const int64_t G = K / QK;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      float v[QK];
      for (int i = 0; i < QK; ++i) v[i] = static_cast<float>(x[r * K + g * QK + i]);
      float amax = 0.0f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float s = amax / 127.0f;
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < QK; ++i) {
        float q = std::nearbyint(v[i] * id);
        q = std::min(127.0f, std::max(-127.0f, q));
        qa[r * K + g * QK + i] = static_cast<int8_t>(q);
        sum += static_cast<int32_t>(q);
      }
      sa[r * G + g] = s;
      Sa[r * G + g] = s * static_cast<float>(sum);
      ia[r * G + g] = sum;
    }
  }
}

void tiles_scalar(const Args& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = a.w + t * a.G * TILE_BYTES;
    const int64_t cols = std::min<int64_t>(TN, a.N - t * TN);
    for (int64_t r = 0; r < a.M; ++r) {
      for (int64_t j = 0; j < cols; ++j) {
        float acc = 0.0f;
        for (int64_t g = 0; g < a.G; ++g) {
          const uint8_t* wg = wt + g * TILE_BYTES;
          const int8_t* xa = a.qa + r * a.K + g * QK;
          int32_t dot = 0;
          for (int p = 0; p < 4; ++p) {
            for (int b = 0; b < 4; ++b) {
              const int32_t byte = wg[64 * p + 4 * j + b];
              dot += (byte & 15) * xa[8 * p + b] + (byte >> 4) * xa[8 * p + 4 + b];
            }
          }
          const float d = half_at(wg + 256 + 2 * j), m = half_at(wg + 288 + 2 * j);
          const float ds = d * a.sa[r * a.G + g];
          acc = std::fma(static_cast<float>(dot), ds, acc);
          acc = std::fma(m, a.Sa[r * a.G + g], acc);
        }
        const int64_t o = t * TN + j;
        a.y[r * a.N + o] = a.bias ? acc + a.bias[o] : acc;
      }
    }
  }
}

void tiles8_scalar(const Args& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = a.w + t * a.G * TILE8_BYTES;
    const int64_t cols = std::min<int64_t>(TN, a.N - t * TN);
    for (int64_t r = 0; r < a.M; ++r) {
      for (int64_t j = 0; j < cols; ++j) {
        float acc = 0.0f;
        for (int64_t g = 0; g < a.G; ++g) {
          const uint8_t* wg = wt + g * TILE8_BYTES;
          const int8_t* xa = a.qa + r * a.K + g * QK;
          int32_t dot = 0;
          for (int p = 0; p < 8; ++p)
            for (int b = 0; b < 4; ++b) dot += (static_cast<int32_t>(wg[64 * p + 4 * j + b]) - 128) * xa[4 * p + b];
          const float ds = half_at(wg + 512 + 2 * j) * a.sa[r * a.G + g];
          acc = std::fma(static_cast<float>(dot), ds, acc);
        }
        const int64_t o = t * TN + j;
        a.y[r * a.N + o] = a.bias ? acc + a.bias[o] : acc;
      }
    }
  }
}

#if TS_X86
// ---------------------------------------------------------------- AVX2 (+FMA, F16C)
#define TS_AVX2 __attribute__((target("avx2,fma,f16c")))

// rne(x * id), clamped to +-127 (|x * id| <= 127 up to one rounding anyway), as int32
TS_AVX2 inline __m256i round8(__m256 x, __m256 id) {
  const __m256 t = _mm256_round_ps(_mm256_mul_ps(x, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), t)));
}

TS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TS_AVX2 inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> float32: the bits shifted up, exact
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename T>
TS_AVX2 void quantize_avx2(const T* x, int64_t M, int64_t K, int8_t* qa, float* sa, float* Sa, int32_t* ia) {
  const int64_t G = K / QK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const T* v = x + r * K + g * QK;
      __m256 x0 = load8(v), x1 = load8(v + 8), x2 = load8(v + 16), x3 = load8(v + 24);
      __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                               _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float amax = _mm_cvtss_f32(h);
      const float s = amax / 127.0f;
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      const __m256i q0 = round8(x0, vid), q1 = round8(x1, vid), q2 = round8(x2, vid), q3 = round8(x3, vid);
      __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      const int32_t sum = _mm_cvtsi128_si32(s4);
      // int32 -> int8 in order: packs (lane-wise) then permute
      __m256i p01 = _mm256_packs_epi32(q0, q1), p23 = _mm256_packs_epi32(q2, q3);
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qa + r * K + g * QK), p);
      sa[r * G + g] = s;
      Sa[r * G + g] = s * static_cast<float>(sum);
      ia[r * G + g] = sum;
    }
  }
}

// Where the product is compute-bound (a first block of >= 5 rows), the weights streamed from memory
// come sooner with a software prefetch 8 tile-groups ahead (-12% at M = 8 and 16 over a SmolLM2
// forward's weights on Zen 4; no gain on the AVX2 path); there a single row is memory-bound and
// slower with it, on a Xeon with AMX 22% faster (q4q8_prefetch_rows: measured per machine).
template <int64_t BYTES = TILE_BYTES>
inline void prefetch_ahead(const uint8_t* wg) {
  for (int c = 0; c < BYTES / 64; ++c) _mm_prefetch(reinterpret_cast<const char*>(wg + 8 * BYTES + 64 * c), _MM_HINT_T0);
}

constexpr int R_AVX2 = 4;

// R rows' results for the 8 output columns from o0 (those below N), plus the bias
template <int R>
TS_AVX2 inline void store_avx2(const Args& a, const __m256* acc, int64_t o0, int64_t r0) {
  const int64_t cols = std::min<int64_t>(8, a.N - o0);
  if (cols <= 0) return;
  alignas(32) float bias[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (a.bias) std::memcpy(bias, a.bias + o0, cols * sizeof(float));
  const __m256 b = _mm256_load_ps(bias);
  for (int i = 0; i < R; ++i) {
    const __m256 out = a.bias ? _mm256_add_ps(acc[i], b) : acc[i];
    float* y = a.y + (r0 + i) * a.N + o0;
    if (cols == 8) {
      _mm256_storeu_ps(y, out);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, out);
      std::memcpy(y, tmp, cols * sizeof(float));
    }
  }
}

// R rows x 8 columns (half h of tile t): u8 x s8 -> s16 pairs (vpmaddubsw; |sum| <= 8 * 2 * 15 *
// 127 = 30480 over a group, no saturation), -> s32 (vpmaddwd by ones) once per group.
template <int R>
TS_AVX2 inline void block_avx2(const Args& a, int64_t t, int h, int64_t r0) {
  const uint8_t* wt = a.w + t * a.G * TILE_BYTES;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = wt + g * TILE_BYTES;
    __m256i s16[R];
    for (int i = 0; i < R; ++i) s16[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * p + 32 * h));
      const __m256i lo = _mm256_and_si256(raw, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      for (int i = 0; i < R; ++i) {
        const int8_t* xa = a.qa + (r0 + i) * a.K + g * QK + 8 * p;
        s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(xa))));
        s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(xa + 4))));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 256 + 16 * h)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 288 + 16 * h)));
    for (int i = 0; i < R; ++i) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[i], ones));
      const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a.sa[(r0 + i) * a.G + g]));
      acc[i] = _mm256_fmadd_ps(dot, ds, acc[i]);
      acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.Sa[(r0 + i) * a.G + g]), acc[i]);
    }
  }
  store_avx2<R>(a, acc, t * TN + 8 * h, r0);
}

// 8-bit weights, R rows x 8 columns: vpmaddubsw wants unsigned x signed with pair sums that fit
// int16, so it takes |q_w| (<= 127) and q_a with q_w's sign (llama.cpp's trick): |pair| <= 32258,
// widened to int32 (vpmaddwd by ones) at once.
template <int R>
TS_AVX2 inline void block8_avx2(const Args& a, int64_t t, int h, int64_t r0) {
  const uint8_t* wt = a.w + t * a.G * TILE8_BYTES;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = wt + g * TILE8_BYTES;
    __m256i s32[R];
    for (int i = 0; i < R; ++i) s32[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * p + 32 * h)), flip);
      const __m256i wabs = _mm256_sign_epi8(w, w);
      for (int i = 0; i < R; ++i) {
        const __m256i xa = _mm256_set1_epi32(load4(a.qa + (r0 + i) * a.K + g * QK + 4 * p));
        const __m256i pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xa, w));
        s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(pairs, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 512 + 16 * h)));
    for (int i = 0; i < R; ++i) {
      const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(a.sa[(r0 + i) * a.G + g]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i]), ds, acc[i]);
    }
  }
  store_avx2<R>(a, acc, t * TN + 8 * h, r0);
}

template <template <int> class Block>
TS_AVX2 void rows_avx2(const Args& a, int64_t t, int h) {
  int64_t r = 0;
  for (; r + R_AVX2 <= a.M; r += R_AVX2) Block<R_AVX2>::run(a, t, h, r);
  switch (a.M - r) {
    case 3: Block<3>::run(a, t, h, r); break;
    case 2: Block<2>::run(a, t, h, r); break;
    case 1: Block<1>::run(a, t, h, r); break;
    default: break;
  }
}

template <int R>
struct Q4Avx2 {
  TS_AVX2 static void run(const Args& a, int64_t t, int h, int64_t r0) { block_avx2<R>(a, t, h, r0); }
};
template <int R>
struct Q8Avx2 {
  TS_AVX2 static void run(const Args& a, int64_t t, int h, int64_t r0) { block8_avx2<R>(a, t, h, r0); }
};

template <template <int> class Block>
TS_AVX2 void tiles_avx2(const Args& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int h = 0; h < 2 && t * TN + 8 * h < a.N; ++h) rows_avx2<Block>(a, t, h);
}

// ---------------------------------------------------------------- AVX512 VNNI
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

TS_AVX512 inline __m512i round16(__m512 x, __m512 id) {
  const __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(x, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), t)));
}

TS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TS_AVX512 inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> float32: the bits shifted up, exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
TS_AVX512 void quantize_avx512(const T* x, int64_t M, int64_t K, int8_t* qa, float* sa, float* Sa, int32_t* ia) {
  const int64_t G = K / QK;
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      const T* v = x + r * K + g * QK;
      const __m512 x0 = load16(v), x1 = load16(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float s = amax / 127.0f;
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 vid = _mm512_set1_ps(id);
      const __m512i q0 = round16(x0, vid), q1 = round16(x1, vid);
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + r * K + g * QK), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + r * K + g * QK + 16), _mm512_cvtsepi32_epi8(q1));
      sa[r * G + g] = s;
      Sa[r * G + g] = s * static_cast<float>(sum);
      ia[r * G + g] = sum;
    }
  }
}

// R rows' results for tile t's 16 output columns (those below N), plus the bias
template <int R>
TS_AVX512 inline void store_avx512(const Args& a, const __m512* acc, int64_t t, int64_t r0) {
  const int64_t o0 = t * TN;
  const int64_t cols = std::min<int64_t>(TN, a.N - o0);
  const __mmask16 keep = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = a.bias ? _mm512_maskz_loadu_ps(keep, a.bias + o0) : _mm512_setzero_ps();
  for (int i = 0; i < R; ++i) {
    const __m512 out = a.bias ? _mm512_add_ps(acc[i], b) : acc[i];
    _mm512_mask_storeu_ps(a.y + (r0 + i) * a.N + o0, keep, out);
  }
}

// Group g's float steps for R rows from r0 of one tile (its bytes for the group at wg), given the
// rows' exact int32 dots `di`: acc = fma(float(dot), d s, acc), then fma(m, S, acc) (4 bits), or
// the dot less 128 * sum(q_a) first (8 bits). Every AVX512 path (VPDPBUSD's, AMX's) takes these.
template <int R>
TS_AVX512 inline void group_steps_q4(const Args& a, const uint8_t* wg, int64_t r0, int64_t g, const __m512i* di,
                                     __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 256)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 288)));
  for (int i = 0; i < R; ++i) {
    const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.sa[(r0 + i) * a.G + g]));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(di[i]), ds, acc[i]);
    acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.Sa[(r0 + i) * a.G + g]), acc[i]);
  }
}

template <int R>
TS_AVX512 inline void group_steps_q8(const Args& a, const uint8_t* wg, int64_t r0, int64_t g, const __m512i* di,
                                     __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 512)));
  for (int i = 0; i < R; ++i) {
    const __m512i dot = _mm512_sub_epi32(di[i], _mm512_set1_epi32(128 * a.ia[(r0 + i) * a.G + g]));
    const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(a.sa[(r0 + i) * a.G + g]));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ds, acc[i]);
  }
}

// R rows x 16 columns (tile t): VPDPBUSD (u8 weights x s8 activations, 4 per lane), int32 per
// group; two int32 accumulators per row when R is small (shorter dependency chains).
template <int R>
TS_AVX512 inline void block_avx512(const Args& a, int64_t t, int64_t r0) {
  constexpr int A = R <= 4 ? 2 : 1;
  const uint8_t* wt = a.w + t * a.G * TILE_BYTES;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = wt + g * TILE_BYTES;
    if (R >= a.prefetch_rows && r0 == 0) prefetch_ahead(wg);
    __m512i dot[R][A];
    for (int i = 0; i < R; ++i)
      for (int k = 0; k < A; ++k) dot[i][k] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i raw = _mm512_loadu_si512(wg + 64 * p);
      const __m512i lo = _mm512_and_si512(raw, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      for (int i = 0; i < R; ++i) {
        const int8_t* xa = a.qa + (r0 + i) * a.K + g * QK + 8 * p;
        dot[i][0] = _mm512_dpbusd_epi32(dot[i][0], lo, _mm512_set1_epi32(load4(xa)));
        dot[i][A - 1] = _mm512_dpbusd_epi32(dot[i][A - 1], hi, _mm512_set1_epi32(load4(xa + 4)));
      }
    }
    __m512i di[R];
    for (int i = 0; i < R; ++i) di[i] = A == 2 ? _mm512_add_epi32(dot[i][0], dot[i][A - 1]) : dot[i][0];
    group_steps_q4<R>(a, wg, r0, g, di, acc);
  }
  store_avx512<R>(a, acc, t, r0);
}

// 8-bit weights, R rows x 16 columns: VPDPBUSD of q_w + 128 (stored so) and q_a, less 128 * sum(q_a)
template <int R>
TS_AVX512 inline void block8_avx512(const Args& a, int64_t t, int64_t r0) {
  constexpr int A = R <= 4 ? 2 : 1;
  const uint8_t* wt = a.w + t * a.G * TILE8_BYTES;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = wt + g * TILE8_BYTES;
    if (R >= a.prefetch_rows && r0 == 0) prefetch_ahead<TILE8_BYTES>(wg);
    __m512i dot[R][A];
    for (int i = 0; i < R; ++i)
      for (int k = 0; k < A; ++k) dot[i][k] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i w = _mm512_loadu_si512(wg + 64 * p);
      for (int i = 0; i < R; ++i) {
        const int8_t* xa = a.qa + (r0 + i) * a.K + g * QK + 4 * p;
        dot[i][p % A] = _mm512_dpbusd_epi32(dot[i][p % A], w, _mm512_set1_epi32(load4(xa)));
      }
    }
    __m512i di[R];
    for (int i = 0; i < R; ++i) di[i] = A == 2 ? _mm512_add_epi32(dot[i][0], dot[i][A - 1]) : dot[i][0];
    group_steps_q8<R>(a, wg, r0, g, di, acc);
  }
  store_avx512<R>(a, acc, t, r0);
}

template <int R>
struct Q4Avx512 {
  TS_AVX512 static void run(const Args& a, int64_t t, int64_t r0) { block_avx512<R>(a, t, r0); }
};
template <int R>
struct Q8Avx512 {
  TS_AVX512 static void run(const Args& a, int64_t t, int64_t r0) { block8_avx512<R>(a, t, r0); }
};

template <template <int> class Block>
TS_AVX512 void tiles_avx512(const Args& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) row_blocks<Block>(a, t);
}

// ---------------------------------------------------------------- AMX (AMX-INT8 tiles)
// Where the CPU has AMX-INT8 and a call has at least AMX_MIN_ROWS rows: blocks of up to 16 rows,
// one TDPBSUD per block, tile and group (A: the rows' 32 int8 activations, B: the group's 8 rows
// of 64 weight bytes, VNNI order, as the packing stores them; C: [rows, 16] int32, the same exact
// dots as VPDPBUSD's), then the AVX512 path's float steps (`group_steps_q4` / `_q8`): the same bits.
#define TS_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,amx-tile,amx-int8")))

constexpr int64_t AMX_MAX_ROWS = 16;
// below 10 rows VPDPBUSD is as fast or faster (a 2-core Xeon with AMX: 3072 x 576, 4 bits, 3 rows
// 59 us against 36; 10 rows 78 against 87; 16 rows 107 against 114; 64 rows 342 against 412)
constexpr int64_t AMX_MIN_ROWS = 10;

// AMX-TILE and AMX-INT8 (cpuid leaf 7), and the kernel's leave to use tile data (Linux asks each
// process to request it: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))
bool amx_usable() {
#if defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

// palette 1; tiles 0..3: C of four groups [rows, 16] int32 (two pairs in flight); 4, 5: a pair's
// A [rows, 32] int8; 6, 7: its B [8, 64] uint8
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TS_AMX inline void configure_amx(int64_t rows) {
  TileConfig c;
  for (int i = 0; i < 4; ++i) {
    c.rows[i] = static_cast<uint8_t>(rows);
    c.colsb[i] = 64;
  }
  for (int i = 4; i < 6; ++i) {
    c.rows[i] = static_cast<uint8_t>(rows);
    c.colsb[i] = QK;
    c.rows[i + 2] = 8;
    c.colsb[i + 2] = 64;
  }
  _tile_loadconfig(&c);
}

// Pair k's B tiles (groups 2k, 2k + 1 < G) into `out`: 4-bit weights unpacked (lo(chunk p) = K quad
// 2p, hi = 2p + 1) into `buf`, 8-bit ones in place.
template <int BITS>
TS_AMX inline void unpack_pair(const uint8_t* wt, int64_t k, int64_t G, uint8_t (*buf)[512], const uint8_t** out) {
  constexpr int64_t TB = BITS == 4 ? TILE_BYTES : TILE8_BYTES;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t h = 0; h < 2 && 2 * k + h < G; ++h) {
    const uint8_t* wg = wt + (2 * k + h) * TB;
    if (BITS == 8) {
      out[h] = wg;
      continue;
    }
    for (int p = 0; p < 4; ++p) {
      const __m512i raw = _mm512_loadu_si512(wg + 64 * p);
      _mm512_store_si512(buf[h] + 128 * p, _mm512_and_si512(raw, mask));
      _mm512_store_si512(buf[h] + 128 * p + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
    }
    out[h] = buf[h];
  }
}

// Pair k's dots into C tiles CA and CB from its B tiles b (tile numbers must be literals: the
// intrinsics are assembler text)
#define TS_AMX_ISSUE(CA, CB, k, b)                \
  do {                                            \
    _tile_zero(CA);                               \
    _tile_loadd(4, xa + 2 * (k) * QK, a.K);       \
    _tile_loadd(6, (b)[0], 64);                   \
    _tile_dpbsud(CA, 4, 6);                       \
    if (2 * (k) + 1 < a.G) {                      \
      _tile_zero(CB);                             \
      _tile_loadd(5, xa + (2 * (k) + 1) * QK, a.K); \
      _tile_loadd(7, (b)[1], 64);                 \
      _tile_dpbsud(CB, 5, 7);                     \
    }                                             \
  } while (0)

#define TS_AMX_STORE(CA, CB, k, out)                          \
  do {                                                        \
    _tile_stored(CA, (out)[0], TN * 4);                       \
    if (2 * (k) + 1 < a.G) _tile_stored(CB, (out)[1], TN * 4); \
  } while (0)

// Pair k's float steps into acc (`group_steps_q4` / `_q8`), its dots in `pair` [2][R][16]
template <int R, int BITS>
TS_AMX inline void finish_pair(const Args& a, const uint8_t* wt, int64_t r0, int64_t k, const int32_t (*pair)[R][TN],
                               __m512* acc) {
  constexpr int64_t TB = BITS == 4 ? TILE_BYTES : TILE8_BYTES;
  for (int64_t gh = 2 * k; gh < std::min(2 * k + 2, a.G); ++gh) {
    __m512i di[R];
    for (int i = 0; i < R; ++i) di[i] = _mm512_load_si512(pair[gh - 2 * k][i]);
    if (BITS == 4)
      group_steps_q4<R>(a, wt + gh * TB, r0, gh, di, acc);
    else
      group_steps_q8<R>(a, wt + gh * TB, r0, gh, di, acc);
  }
}

// R rows x tile t, groups in pairs, software-pipelined so that no step waits on the one before:
// in round k, pair k + 2's weights are unpacked, pair k + 1's tile products issued, pair k's
// dots stored and pair k - 1's float steps run.
template <int R, int BITS>
TS_AMX inline void block_amx(const Args& a, int64_t t, int64_t r0) {
  constexpr int64_t TB = BITS == 4 ? TILE_BYTES : TILE8_BYTES;
  const uint8_t* wt = a.w + t * a.G * TB;
  const int8_t* xa = a.qa + r0 * a.K;
  const int64_t pairs = (a.G + 1) / 2;
  alignas(64) uint8_t buf[3][2][512];
  const uint8_t* b[3][2] = {};
  alignas(64) int32_t c[2][2][R][TN];
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  unpack_pair<BITS>(wt, 0, a.G, buf[0], b[0]);
  if (pairs > 1) unpack_pair<BITS>(wt, 1, a.G, buf[1], b[1]);
  TS_AMX_ISSUE(0, 1, 0, b[0]);
  for (int64_t k = 0; k < pairs; ++k) {
    if (R >= a.prefetch_rows && r0 == 0) prefetch_ahead<TB>(wt + 2 * k * TB);
    if (k + 2 < pairs) unpack_pair<BITS>(wt, k + 2, a.G, buf[(k + 2) % 3], b[(k + 2) % 3]);
    if (k % 2 == 0) {
      if (k + 1 < pairs) TS_AMX_ISSUE(2, 3, k + 1, b[(k + 1) % 3]);
      TS_AMX_STORE(0, 1, k, c[0]);
    } else {
      if (k + 1 < pairs) TS_AMX_ISSUE(0, 1, k + 1, b[(k + 1) % 3]);
      TS_AMX_STORE(2, 3, k, c[1]);
    }
    if (k > 0) finish_pair<R, BITS>(a, wt, r0, k - 1, c[(k - 1) % 2], acc);
  }
  finish_pair<R, BITS>(a, wt, r0, pairs - 1, c[(pairs - 1) % 2], acc);
  store_avx512<R>(a, acc, t, r0);
}
#undef TS_AMX_ISSUE
#undef TS_AMX_STORE

template <int BITS, int R>
TS_AMX void run_amx(const Args& a, int64_t t0, int64_t t1, int64_t r0) {
  for (int64_t t = t0; t < t1; ++t) block_amx<R, BITS>(a, t, r0);
}

// Tiles t0..t1 for every row: EvenBlocks of at most 16 rows, each block over all the tiles under
// one tile configuration.
template <int BITS>
TS_AMX void tiles_amx(const Args& a, int64_t t0, int64_t t1) {
  const EvenBlocks split(a.M, AMX_MAX_ROWS);
  for (int64_t k = 0, r = 0; k < split.count; ++k) {
    const int64_t rows = split.rows(k);
    configure_amx(rows);
    switch (rows) {
#define TS_AMX_ROWS(n) \
  case n: run_amx<BITS, n>(a, t0, t1, r); break;
      TS_AMX_ROWS(16) TS_AMX_ROWS(15) TS_AMX_ROWS(14) TS_AMX_ROWS(13) TS_AMX_ROWS(12) TS_AMX_ROWS(11)
      TS_AMX_ROWS(10) TS_AMX_ROWS(9) TS_AMX_ROWS(8) TS_AMX_ROWS(7) TS_AMX_ROWS(6) TS_AMX_ROWS(5)
      TS_AMX_ROWS(4) TS_AMX_ROWS(3) TS_AMX_ROWS(2) default: run_amx<BITS, 1>(a, t0, t1, r); break;
#undef TS_AMX_ROWS
    }
    r += rows;
  }
  _tile_release();
}
#endif  // TS_X86

// ---------------------------------------------------------------- dispatch

int64_t supported_mask() {
  int64_t mask = 1 << SCALAR;
#if TS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) mask |= 1 << AVX2;  // f16c: with AVX2
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni")) {
    mask |= 1 << AVX512VNNI;
    if (amx_usable()) mask |= 1 << AMX;
  }
#endif
  return mask;
}

// -1: the best path this CPU runs, capped by the environment; >= 0: exactly that path (an error if
// this CPU cannot run it); -2: the bit mask of the paths this CPU runs.
int64_t q4q8_isa(int64_t isa) {
  static const int64_t mask = supported_mask();
  static const int64_t best = [] {
    int64_t b = cap_from_env();
    while (b > SCALAR && !(mask & (1 << b))) --b;
    return b;
  }();
  if (isa == -2) return mask;
  if (isa == -1) return best;
  TORCH_CHECK(isa >= SCALAR && isa <= AMX && (mask & (1 << isa)),
              "q4q8_linear: path ", isa, " is not available on this CPU (mask ", mask, ")");
  return isa;
}

// y = x @ W^T (+ bias) for W packed in `bits` (4: pack_q4's tiles, 8: pack_q8's)
at::Tensor quantized_linear(const char* op, int bits, const at::Tensor& x, const at::Tensor& packed,
                            const std::optional<at::Tensor>& bias, int64_t n, int64_t isa) {
  TORCH_CHECK(x.dim() >= 1, op, ": x needs a last dimension K");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K > 0 && K % QK == 0, op, ": K = ", K, " is not a multiple of ", QK);
  TORCH_CHECK(n > 0, op, ": n = ", n);
  const int64_t G = K / QK, T = (n + TN - 1) / TN, tile_bytes = bits == 4 ? TILE_BYTES : TILE8_BYTES;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == T * G * tile_bytes,
              op, ": packed weights must be contiguous uint8 of ", T * G * tile_bytes, " bytes for n = ", n,
              ", K = ", K, "; got ", packed.numel());
  isa = q4q8_isa(isa);
  // bfloat16 rows are read as they are (each value exactly a float32); other dtypes converted first
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const at::Tensor xc = bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias needs ", n, " values");
    b = bias->to(at::kFloat).contiguous();
  }
  std::vector<int8_t> qa(M * K);
  std::vector<float> sa(M * G), Sa(M * G);
  std::vector<int32_t> ia(M * G);
  // rows are quantized alone (any split of them gives the same bytes)
  auto quantize = [&](const auto* xp) {
    at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
      const auto* xr = xp + r0 * K;
      int8_t* q = qa.data() + r0 * K;
      float *s = sa.data() + r0 * G, *S = Sa.data() + r0 * G;
      int32_t* i = ia.data() + r0 * G;
#if TS_X86
      if (isa >= AVX512VNNI) return quantize_avx512(xr, r1 - r0, K, q, s, S, i);
      if (isa == AVX2) return quantize_avx2(xr, r1 - r0, K, q, s, S, i);
#endif
      quantize_scalar(xr, r1 - r0, K, q, s, S, i);
    });
  };
  if (bf16)
    quantize(xc.data_ptr<at::BFloat16>());
  else
    quantize(xc.data_ptr<float>());

  Args a{qa.data(), sa.data(), Sa.data(), ia.data(), packed.data_ptr<uint8_t>(),
         b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, n, K, G, T,
         prefetch_min_rows.load()};
  // Split over output tiles only; each output is computed by one thread in one fixed order.
  // Grain: a chunk of at least ~128k multiply-adds (rows counted up to 16), or threads do not pay.
  const int64_t per_tile = G * QK * TN * std::min<int64_t>(M, 16);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / per_tile);
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
#if TS_X86
    if (isa == AMX && M >= AMX_MIN_ROWS) return bits == 4 ? tiles_amx<4>(a, t0, t1) : tiles_amx<8>(a, t0, t1);
    if (isa >= AVX512VNNI) return bits == 4 ? tiles_avx512<Q4Avx512>(a, t0, t1) : tiles_avx512<Q8Avx512>(a, t0, t1);
    if (isa == AVX2) return bits == 4 ? tiles_avx2<Q4Avx2>(a, t0, t1) : tiles_avx2<Q8Avx2>(a, t0, t1);
#endif
    bits == 4 ? tiles_scalar(a, t0, t1) : tiles8_scalar(a, t0, t1);
  });
  return y;
}

at::Tensor q4q8_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t isa) {
  return quantized_linear("q4q8_linear", 4, x, packed, bias, n, isa);
}

at::Tensor q8q8_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t isa) {
  return quantized_linear("q8q8_linear", 8, x, packed, bias, n, isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treespec, m) {
  m.def("q4q8_linear(Tensor x, Tensor packed, Tensor? bias, int n, int isa=-1) -> Tensor");
  m.def("q8q8_linear(Tensor x, Tensor packed, Tensor? bias, int n, int isa=-1) -> Tensor");
  m.def("q4q8_isa(int isa=-1) -> int", &q4q8_isa);
  m.def("q4q8_prefetch_rows(int rows=-1) -> int", &q4q8_prefetch_rows);
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("q4q8_linear", &q4q8_linear);
  m.impl("q8q8_linear", &q8q8_linear);
}
