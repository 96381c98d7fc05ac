// Tile kernels for bfloat16 activations as they are (not quantized) times integer weights, on
// AVX512-BF16 cores: VDPBF16PS over bf16 pairs (small integers are exact in bf16), each weight
// tile unpacked once for every row of the call, parallel over output tiles only, so a row's
// result never depends on the other rows. Float32 totals, rounded once to the bfloat16 output.
// Elsewhere the Python side keeps torch's kernels (bf16.py).
//
// treespec::q4bf16_linear: W in torch's int4 form w = (q - 8) s + z per output row and group of 32
// (s, z float32: the values aten's int4 kernel multiplies by), as s * dot_g(128 + q, x) +
// (z - 136 s) * sum_g(x) per group: the same model as `_weight_int4pack_mm_for_cpu` up to float32
// rounding. Layout (pack_q4s): per tile of 16 columns and group 384 bytes: 4 chunks c of 32
// little-endian 16-bit words, word u with nibble e (bits 4e..4e+3) = q[u / 2, 8c + 2e + u % 2]
// (bytes [0, 256)), then s and z - 136 s of the 16 columns (float32, [256, 320), [320, 384)).
//
// treespec::q8bf16_linear: W = diag(s) Q, Q int8 [N, K] with one scale per output row (weight-only
// int8, `linear.QuantizedProjection`), as s * dot(Q, x) over the whole row: the same model as
// `_weight_int8pack_mm` up to float32 rounding; `float_out`: the float32 totals as they are (an
// output layer's logits), not rounded to bfloat16. Layout (pack_q8s): per tile of 16 columns, K / 4
// chunks of 64 bytes (column j at bytes 4j..4j+3 = Q[j, 4c..4c+3]), then the 16 scales (float32).
#include "isa.h"

#include <vector>

namespace {

using namespace treespec_kernels;

constexpr int64_t TILE4S_BYTES = 384;  // per tile and group of q4bf16's weights

struct ArgsB {
  const uint16_t* x;  // [M, K] bfloat16 bits
  const float* S;     // [M, G] sum of each group's x (q4bf16 only)
  const uint8_t* w;   // the packed weights
  const float* bias;  // [N] or nullptr
  void* y;            // [M, N] bfloat16, or float32 where f32
  int64_t M, N, K, G;
  bool f32;
};

// y[r, o] = v: rounded to bfloat16 (nearest even), or as it is where a.f32
inline void put(const ArgsB& a, int64_t r, int64_t o, float v) {
  if (a.f32)
    static_cast<float*>(a.y)[r * a.N + o] = v;
  else
    static_cast<at::BFloat16*>(a.y)[r * a.N + o] = at::BFloat16(v);
}

#if TS_X86
#define TS_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

inline uint64_t load8(const uint16_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// The 16 columns' totals, two float32 lanes a column (tot[0]: columns 0..7, tot[1]: 8..15), into y.
TS_BF16 inline void store_row(const ArgsB& a, int64_t t, int64_t r, const __m512 tot[2], const float* scale) {
  alignas(64) float lanes[32];
  _mm512_store_ps(lanes, tot[0]);
  _mm512_store_ps(lanes + 16, tot[1]);
  const int64_t o0 = t * TN;
  const int64_t cols = std::min<int64_t>(TN, a.N - o0);
  for (int64_t j = 0; j < cols; ++j) {
    float v = lanes[2 * j] + lanes[2 * j + 1];
    if (scale) v *= scale[j];
    put(a, r, o0 + j, a.bias ? v + a.bias[o0 + j] : v);
  }
}

// The 16 columns' totals, one float32 lane a column, into y.
TS_BF16 inline void store_cols(const ArgsB& a, int64_t t, int64_t r, __m512 tot) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, tot);
  const int64_t o0 = t * TN;
  const int64_t cols = std::min<int64_t>(TN, a.N - o0);
  for (int64_t j = 0; j < cols; ++j) put(a, r, o0 + j, a.bias ? lanes[j] + a.bias[o0 + j] : lanes[j]);
}

// R rows x 16 columns of q4bf16, one float32 lane a column. Each 16-bit word of the tile holds
// four nibbles; (word >> 4s) & 15 | 0x4300 is the bf16 of 128 + q, exact, with no shuffle: 32
// words give the pairs (k, k+1) of 16 columns, met by a 32-bit broadcast of x[k], x[k+1]. So a
// group's dot is dot(128 + q, x), and (q - 8) s + z = (128 + q) s + (z - 136 s): the tiles hold
// s and z' = z - 136 s (pack_q4s). Two accumulators a row halve the VDPBF16PS chains, in every
// block alike (a row's arithmetic never depends on how many rows share it).
template <int R>
TS_BF16 inline void block_q4(const ArgsB& a, int64_t t, int64_t r0) {
  constexpr int A = 2;  // accumulators a row
  const uint8_t* wt = a.w + t * a.G * TILE4S_BYTES;
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bias = _mm512_set1_epi16(0x4300);
  __m512 tot[R];
  for (int i = 0; i < R; ++i) tot[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = wt + g * TILE4S_BYTES;
    __m512 dot[R][A];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < A; ++j) dot[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(wg + 64 * c);
      __m512bh w[4];
      w[0] = (__m512bh)_mm512_ternarylogic_epi32(raw, low4, bias, 0xEA);  // (a & b) | c
      w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), low4, bias, 0xEA);
      w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 8), low4, bias, 0xEA);
      w[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(raw, 12), bias);
      for (int e = 0; e < 4; ++e)
        for (int i = 0; i < R; ++i) {
          int32_t pair;
          std::memcpy(&pair, a.x + (r0 + i) * a.K + g * QK + 8 * c + 2 * e, 4);
          dot[i][e % A] = _mm512_dpbf16_ps(dot[i][e % A], w[e], (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    const __m512 sv = _mm512_loadu_ps(reinterpret_cast<const float*>(wg + 256));
    const __m512 zv = _mm512_loadu_ps(reinterpret_cast<const float*>(wg + 320));
    for (int i = 0; i < R; ++i) {
      const __m512 d = A == 2 ? _mm512_add_ps(dot[i][0], dot[i][A - 1]) : dot[i][0];
      tot[i] = _mm512_fmadd_ps(zv, _mm512_set1_ps(a.S[(r0 + i) * a.G + g]), _mm512_fmadd_ps(d, sv, tot[i]));
    }
  }
  for (int i = 0; i < R; ++i) store_cols(a, t, r0 + i, tot[i]);
}

// R rows x 16 columns of q8bf16: each 64-byte chunk (4 inputs of 16 columns) becomes two bf16
// vectors in the lane order of block_q4's (int8 -> int32 -> float32 -> bf16, all exact).
template <int R>
TS_BF16 inline void block_q8(const ArgsB& a, int64_t t, int64_t r0) {
  const uint8_t* wt = a.w + t * (a.K * TN + 4 * TN);
  __m512 tot[R][2];
  for (int i = 0; i < R; ++i) tot[i][0] = tot[i][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < a.K / 4; ++c) {
    const uint8_t* wc = wt + 64 * c;
    const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc))));
    const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 16))));
    const __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 32))));
    const __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + 48))));
    const __m512bh w0 = _mm512_cvtne2ps_pbh(f1, f0), w1 = _mm512_cvtne2ps_pbh(f3, f2);
    for (int i = 0; i < R; ++i) {
      const __m512bh xa = (__m512bh)_mm512_set1_epi64(static_cast<long long>(load8(a.x + (r0 + i) * a.K + 4 * c)));
      tot[i][0] = _mm512_dpbf16_ps(tot[i][0], w0, xa);
      tot[i][1] = _mm512_dpbf16_ps(tot[i][1], w1, xa);
    }
  }
  const float* scale = reinterpret_cast<const float*>(wt + a.K * TN);
  for (int i = 0; i < R; ++i) store_row(a, t, r0 + i, tot[i], scale);
}

template <int R>
struct Q4 {
  TS_BF16 static void run(const ArgsB& a, int64_t t, int64_t r0) { block_q4<R>(a, t, r0); }
};
template <int R>
struct Q8 {
  TS_BF16 static void run(const ArgsB& a, int64_t t, int64_t r0) { block_q8<R>(a, t, r0); }
};

template <template <int> class Block>
TS_BF16 void tiles(const ArgsB& a, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) row_blocks<Block>(a, t);
}
#endif  // TS_X86

// whether the kernels run here: an AVX512-BF16 core, the path not capped below AVX512 by
// TREESPEC_KERNEL_ISA or ATEN_CPU_CAPABILITY
bool bf16_available() {
  static const bool ok = avx512_runs(true);
  return ok;
}

// y [..., n] bfloat16 (float32 where float_out) = x [..., K] bfloat16 @ W^T (+ bias), W packed in
// `bits` (4: pack_q4s's tiles, 8: pack_q8s's) of `tile_bytes` per tile
at::Tensor bf16_linear(const char* op, int bits, const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias, int64_t n, bool float_out) {
  TORCH_CHECK(bf16_available(), op, ": needs an AVX512-BF16 core");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kBFloat16, op, ": x must be bfloat16 [..., K]");
  const int64_t K = x.size(-1), step = bits == 4 ? QK : 4;
  TORCH_CHECK(K > 0 && K % step == 0, op, ": K = ", K, " is not a multiple of ", step);
  const int64_t G = K / QK, T = (n + TN - 1) / TN;
  const int64_t tile_bytes = bits == 4 ? G * TILE4S_BYTES : K * TN + 4 * TN;
  TORCH_CHECK(n > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == T * tile_bytes,
              op, ": packed weights must be contiguous uint8 of ", T * tile_bytes, " bytes for n = ", n,
              ", K = ", K, "; got ", packed.numel());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias needs ", n, " values");
    b = bias->to(at::kFloat).contiguous();
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  std::vector<float> S;
  if (bits == 4) {  // each group's sum, in order
    S.resize(M * G);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.0f;
        for (int64_t k = 0; k < QK; ++k) {
          const uint32_t bits32 = static_cast<uint32_t>(xp[r * K + g * QK + k]) << 16;
          float v;
          std::memcpy(&v, &bits32, 4);
          acc += v;
        }
        S[r * G + g] = acc;
      }
  }
#if TS_X86
  const ArgsB a{xp, S.data(), packed.data_ptr<uint8_t>(), b.defined() ? b.data_ptr<float>() : nullptr,
                y.data_ptr(), M, n, K, G, float_out};
  // a chunk of at least ~128k multiply-adds (rows counted up to 16), or threads do not pay
  const int64_t per_tile = K * TN * std::min<int64_t>(M, 16);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / per_tile);
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    bits == 4 ? tiles<Q4>(a, t0, t1) : tiles<Q8>(a, t0, t1);
  });
#endif
  return y;
}

at::Tensor q4bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t n) {
  return bf16_linear("q4bf16_linear", 4, x, packed, bias, n, false);
}

at::Tensor q8bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t n, bool float_out) {
  return bf16_linear("q8bf16_linear", 8, x, packed, bias, n, float_out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treespec, m) {
  m.def("q4bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("q8bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n, bool float_out=False) -> Tensor");
  m.def("bf16_available() -> bool", &bf16_available);
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) {
  m.impl("q4bf16_linear", &q4bf16_linear);
  m.impl("q8bf16_linear", &q8bf16_linear);
}
