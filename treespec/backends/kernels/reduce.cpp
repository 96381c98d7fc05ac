// treespec::row_max: each row's maximum and the index of its first occurrence, as torch.max(x, -1)
// gives them (a NaN counts as the maximum: the first NaN), for float32 or bfloat16 rows on a CPU.
// torch's CPU max over a dim is scalar (44 us for a row of 49,152); this is one vectorised pass
// for the maximum (NaN-propagating) and a scan for its first index (~3 us).
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <tuple>
#include <utility>

#include "isa.h"

namespace {

using namespace treespec_kernels;

#if TS_X86
#define TS_RED __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// 16 values of a row from j on (lanes past V: -inf), as float32
TS_RED inline __m512 load(const void* p, bool bf16, int64_t j, int64_t V) {
  const __mmask16 live = V - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (V - j)) - 1);
  __m512 v;
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(live, static_cast<const uint16_t*>(p) + j);
    v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    v = _mm512_maskz_loadu_ps(live, static_cast<const float*>(p) + j);
  }
  return _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), v);
}

// (the row's maximum, NaN if any value is NaN; the first index holding it, or the first NaN)
TS_RED std::pair<float, int64_t> row_top(const void* p, bool bf16, int64_t V) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < V; j += 16) {
    const __m512 v = load(p, bf16, j, V);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  const float top = nan ? NAN : _mm512_reduce_max_ps(m);
  const __m512 t = _mm512_set1_ps(top);
  for (int64_t j = 0; j < V; j += 16) {
    const __m512 v = load(p, bf16, j, V);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
    if (hit) return {top, j + __builtin_ctz(hit)};
  }
  return {top, 0};  // a row of -inf only: its first index, as torch
}
#endif

bool row_max_available() {
  static const bool ok = avx512_runs(false);
  return ok;
}

std::tuple<at::Tensor, at::Tensor> row_max(const at::Tensor& x) {
  TORCH_CHECK(row_max_available(), "row_max: needs an AVX512 core");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "row_max: float32 or bfloat16 rows [n, V], V > 0");
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(0), V = xc.size(1);
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  at::Tensor values = at::empty({n}, xc.options().dtype(at::kFloat));
  at::Tensor indices = at::empty({n}, xc.options().dtype(at::kLong));
#if TS_X86
  for (int64_t r = 0; r < n; ++r) {
    const auto [top, j] = row_top(static_cast<const char*>(xc.data_ptr()) + r * V * xc.element_size(), bf16, V);
    values.data_ptr<float>()[r] = top;
    indices.data_ptr<int64_t>()[r] = j;
  }
#endif
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treespec, m) {
  m.def("row_max(Tensor x) -> (Tensor, Tensor)");
  m.def("row_max_available() -> bool", &row_max_available);
}

TORCH_LIBRARY_IMPL(treespec, CPU, m) { m.impl("row_max", &row_max); }
