// treespec::row_attention: softmax attention in which a query row's result depends only on the
// keys it sees, never on the other rows of the call, the cache's span or where masked keys sit.
//
//   q [n, Hq, D]; k, v [B, Hkv, S, D] (B lanes; any lane, head and slot strides, unit stride on
//   D); mask bool [n, S] (True = attend); lanes int64 [n], the lane each row reads (None: all
//   lane 0). Query head h reads kv head h / (Hq / Hkv). Returns [n, Hq * D] in q's dtype; float32
//   or bfloat16 inputs, float32 arithmetic.
//
// For one row and head the visible slots j_0 < j_1 < ... < j_{m-1} are walked in that order, and
// every sum is taken in an order fixed by a key's rank among them (never by its slot or by S):
//   s_i = scale * dot(q, k_{j_i})       (16 lanes over D, then a fixed lane reduction)
//   e_i = exp(s_i - max_i s_i)          (one polynomial; lanes past the last key are exact zeros)
//   Z   = sum of e_i                    (lane i mod 16, then the fixed lane reduction)
//   out = (sum over i, in order, of e_i v_{j_i}) / Z
// A tree node sees the committed prefix and its ancestors, which are exactly the keys its path
// sees when decoded alone, in the same order: so it scores bit for bit as that path does, and
// greedy speculative decoding equals greedy plain decoding token for token. torch's CPU SDPA does
// not: its blocks and vector tails follow the span and the mask layout.
#include <c10/util/BFloat16.h>

#include <cmath>
#include <utility>
#include <vector>

#include "isa.h"

namespace {

using namespace treespec_kernels;

struct AttnArgs {
  const char* q;  // [n, Hq, D]
  const char* k;  // [Hkv, S, D]
  const char* v;
  const bool* mask;      // [n, S]
  const int64_t* lanes;  // [n] or nullptr (every row: lane 0)
  char* out;             // [n, Hq * D]
  int64_t q_row, q_head, k_lane, k_head, k_slot, v_lane, v_head, v_slot;  // strides, in elements
  int64_t n, S, Hq, Hkv, D;
  bool q_bf16, kv_bf16;
  float scale;
};

#if TS_X86
#define TS_ATTN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// the values at p (bfloat16 or float32) of the lanes in `live` as float32, the others 0
TS_ATTN inline __m512 load16(const char* p, bool bf16, __mmask16 live) {
  if (!bf16) return _mm512_maskz_loadu_ps(live, reinterpret_cast<const float*>(p));
  const __m256i h = _mm256_maskz_loadu_epi16(live, reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 (x = -inf gives 0): x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (Horner), scaled by 2^n; one sequence of operations for every lane
TS_ATTN inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));  // e^-103 underflows to 0 in the scaling
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The lane sums of 16 vectors a[0..15], as one vector (lane l: the sum of a[l]'s lanes), each by
// the same tree: lanes p and p + 8 first, then p + 4, p + 2 and p + 1
TS_ATTN inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i]'s p + (p + 8); lanes 8-15: a[2i + 1]'s
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit block j: the 4 partial sums of a[4i + j]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block j: 2 partials of a[8i + j], then 2 of a[8i + 4 + j]
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  // block j, lane s: the sum of a[4s + j]; then lane l = a[l]'s
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// GB query heads h0 .. h0 + GB - 1 of row t over its M visible keys `keys` of kv head (kc, vc),
// together: each key's and value's chunks are loaded (and widened from bf16) once for the GB
// heads, then each head takes exactly the steps it took alone (C = D / 16 chunks of the head dim,
// rounded up, kept in registers); `e`: GB rows of Mp floats
template <int C, int GB>
TS_ATTN void heads_together(const AttnArgs& a, int64_t t, int64_t h0, const char* kc, const char* vc,
                            const int32_t* keys, int64_t M, float* e) {
  const int64_t kvsize = a.kv_bf16 ? 2 : 4, Mp = (M + 15) / 16 * 16;
  __mmask16 lanes[C];  // the head dim's lanes in each chunk of 16 (the last may be short)
  for (int u = 0; u < C; ++u)
    lanes[u] = a.D - 16 * u >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (a.D - 16 * u)) - 1);
  __m512 q[GB][C];
  for (int hh = 0; hh < GB; ++hh) {
    const char* qp = a.q + (t * a.q_row + (h0 + hh) * a.q_head) * (a.q_bf16 ? 2 : 4);
    for (int u = 0; u < C; ++u) q[hh][u] = load16(qp + 16 * u * (a.q_bf16 ? 2 : 4), a.q_bf16, lanes[u]);
  }
  // scores: per key and head, 16 lanes over D; the lanes of 16 keys at a time summed by `sum16`
  for (int64_t i0 = 0; i0 < M; i0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, M - i0);
    __m512 part[GB][16];
    for (int64_t l = 0; l < 16; ++l) {
      if (l >= cnt) {
        for (int hh = 0; hh < GB; ++hh) part[hh][l] = _mm512_setzero_ps();
        continue;
      }
      const char* kp = kc + keys[i0 + l] * a.k_slot * kvsize;
      __m512 kf = load16(kp, a.kv_bf16, lanes[0]);
      for (int hh = 0; hh < GB; ++hh) part[hh][l] = _mm512_mul_ps(q[hh][0], kf);
      for (int u = 1; u < C; ++u) {
        kf = load16(kp + 16 * u * kvsize, a.kv_bf16, lanes[u]);
        for (int hh = 0; hh < GB; ++hh) part[hh][l] = _mm512_fmadd_ps(q[hh][u], kf, part[hh][l]);
      }
    }
    for (int hh = 0; hh < GB; ++hh)
      _mm512_storeu_ps(e + hh * Mp + i0, _mm512_mul_ps(sum16(part[hh]), _mm512_set1_ps(a.scale)));
  }
  // softmax weights, unnormalised, and their sum Z (lanes past the last key: exact zeros)
  __m512 Z[GB];
  for (int hh = 0; hh < GB; ++hh) {
    float* eh = e + hh * Mp;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < Mp; i += 16) {
      const __mmask16 live = M - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (M - i)) - 1);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, eh + i));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 z = _mm512_setzero_ps();
    for (int64_t i = 0; i < Mp; i += 16) {
      const __mmask16 live = M - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (M - i)) - 1);
      const __m512 w = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(eh + i), top)));
      _mm512_storeu_ps(eh + i, w);
      z = _mm512_add_ps(z, w);
    }
    Z[hh] = _mm512_set1_ps(_mm512_reduce_add_ps(z));
  }
  // the weighted values, key by key in order
  __m512 acc[GB][C];
  for (int hh = 0; hh < GB; ++hh)
    for (int u = 0; u < C; ++u) acc[hh][u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < M; ++i) {
    const char* vp = vc + keys[i] * a.v_slot * kvsize;
    __m512 w[GB];
    for (int hh = 0; hh < GB; ++hh) w[hh] = _mm512_set1_ps(e[hh * Mp + i]);
    for (int u = 0; u < C; ++u) {
      const __m512 vf = load16(vp + 16 * u * kvsize, a.kv_bf16, lanes[u]);
      for (int hh = 0; hh < GB; ++hh) acc[hh][u] = _mm512_fmadd_ps(w[hh], vf, acc[hh][u]);
    }
  }
  for (int hh = 0; hh < GB; ++hh) {
    const int64_t o = (t * a.Hq + h0 + hh) * a.D;
    for (int u = 0; u < C; ++u) {
      const __m512 r = _mm512_div_ps(acc[hh][u], Z[hh]);
      if (a.q_bf16) {
        alignas(64) float f[16];
        _mm512_store_ps(f, r);
        auto* y = reinterpret_cast<at::BFloat16*>(a.out) + o + 16 * u;
        for (int l = 0; l < 16 && 16 * u + l < a.D; ++l) y[l] = at::BFloat16(f[l]);  // round to nearest even
      } else {
        _mm512_mask_storeu_ps(reinterpret_cast<float*>(a.out) + o + 16 * u, lanes[u], r);
      }
    }
  }
}

constexpr int GB_MAX = 4;  // query heads taken together (a kv head's g heads in groups of at most 4)

// Row t, kv head c: its g query heads over the row's visible keys, in groups of up to GB_MAX
template <int C>
TS_ATTN void row_head(const AttnArgs& a, int64_t t, int64_t c, std::vector<int32_t>& keys, std::vector<float>& e) {
  const int64_t g = a.Hq / a.Hkv, kvsize = a.kv_bf16 ? 2 : 4;
  keys.clear();
  const bool* m = a.mask + t * a.S;
  for (int64_t j = 0; j < a.S; ++j)
    if (m[j]) keys.push_back(static_cast<int32_t>(j));
  const int64_t M = static_cast<int64_t>(keys.size()), Mp = (M + 15) / 16 * 16;
  e.resize(GB_MAX * Mp);
  const int64_t b = a.lanes ? a.lanes[t] : 0;
  const char* kc = a.k + (b * a.k_lane + c * a.k_head) * kvsize;
  const char* vc = a.v + (b * a.v_lane + c * a.v_head) * kvsize;
  for (int64_t h = c * g; h < (c + 1) * g; h += GB_MAX) {
    switch (std::min<int64_t>(GB_MAX, (c + 1) * g - h)) {
      case 4: heads_together<C, 4>(a, t, h, kc, vc, keys.data(), M, e.data()); break;
      case 3: heads_together<C, 3>(a, t, h, kc, vc, keys.data(), M, e.data()); break;
      case 2: heads_together<C, 2>(a, t, h, kc, vc, keys.data(), M, e.data()); break;
      default: heads_together<C, 1>(a, t, h, kc, vc, keys.data(), M, e.data()); break;
    }
  }
}

using RowHead = void (*)(const AttnArgs&, int64_t, int64_t, std::vector<int32_t>&, std::vector<float>&);

template <int... Cs>
RowHead pick(int64_t C, std::integer_sequence<int, Cs...>) {
  RowHead fns[] = {&row_head<Cs + 1>...};
  return fns[C - 1];
}
#endif  // TS_X86

// whether the kernel runs here: an AVX512 core, the path not capped below AVX512
bool row_attention_available() {
  static const bool ok = avx512_runs(false);
  return ok;
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                         const std::optional<at::Tensor>& lanes, double scale) {
  TORCH_CHECK(row_attention_available(), "row_attention: needs an AVX512 core");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4,
              "row_attention: q [n, Hq, D], k and v [B, Hkv, S, D]");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t B = k.size(0), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(float_or_bf16(q) && float_or_bf16(k) && k.scalar_type() == v.scalar_type(),
              "row_attention: float32 or bfloat16 q, and k, v of one such dtype");
  TORCH_CHECK(v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D && v.size(3) == D,
              "row_attention: k and v must both be [B, Hkv, S, D] with q's D");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "row_attention: Hq a multiple of Hkv");
  TORCH_CHECK(D > 0 && D <= 256, "row_attention: a head dim of at most 256");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "row_attention: unit stride on D");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == n && mask.size(1) == S,
              "row_attention: mask bool [n, S]");
  at::Tensor lc;
  if (lanes.has_value()) {
    lc = lanes->contiguous();
    TORCH_CHECK(lc.scalar_type() == at::kLong && lc.dim() == 1 && lc.size(0) == n,
                "row_attention: lanes int64 [n]");
    const int64_t* l = lc.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(l[i] >= 0 && l[i] < B, "row_attention: lanes must lie in [0, ", B, ")");
  } else {
    TORCH_CHECK(B == 1, "row_attention: ", B, " lanes need each row's lane (lanes [n])");
  }
  const at::Tensor mc = mask.contiguous();
  at::Tensor out = at::empty({n, Hq * D}, q.options());
  AttnArgs a{static_cast<const char*>(q.data_ptr()),
             static_cast<const char*>(k.data_ptr()),
             static_cast<const char*>(v.data_ptr()),
             mc.data_ptr<bool>(),
             lanes.has_value() ? lc.data_ptr<int64_t>() : nullptr,
             static_cast<char*>(out.data_ptr()),
             q.stride(0),
             q.stride(1),
             k.stride(0),
             k.stride(1),
             k.stride(2),
             v.stride(0),
             v.stride(1),
             v.stride(2),
             n,
             S,
             Hq,
             Hkv,
             D,
             q.scalar_type() == at::kBFloat16,
             k.scalar_type() == at::kBFloat16,
             static_cast<float>(scale)};
#if TS_X86
  // one task per (row, kv head): each computed whole by one thread
  const RowHead run = pick((D + 15) / 16, std::make_integer_sequence<int, 16>{});
  at::parallel_for(0, n * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> keys;
    std::vector<float> e;
    for (int64_t i = t0; i < t1; ++i) run(a, i / Hkv, i % Hkv, keys, e);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treespec, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor? lanes, float scale) -> Tensor");
  m.def("row_attention_available() -> bool", &row_attention_available);
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) { m.impl("row_attention", &row_attention); }
