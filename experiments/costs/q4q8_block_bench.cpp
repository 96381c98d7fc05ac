// The q4q8 kernel's AVX512 block (treespec/backends/kernels/q4q8.cpp) and variants of it, one
// thread, random weights, min over repeats (issue 58; docs/performance.md, "The q4q8 kernel"):
//
//   g++ -O3 -ffp-contract=off -fopenmp experiments/costs/q4q8_block_bench.cpp -o /tmp/qb && /tmp/qb 16
//
// prints VPDPBUSD's own rate (12 independent chains), then per shape of SmolLM2's products GMAC/s
// of the shipped block (R rows x 16 columns), two tiles x R rows (one activation broadcast for
// two tiles), the block without each of its float ops (timing only, wrong numbers), and the
// integer part alone. Not a test: the numbers are what the block's instruction mix allows.
#include <immintrin.h>
#ifndef PF
#define PF 1  // software prefetch in the first row block (as q4q8.cpp does from 5 rows)
#endif
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
constexpr int64_t QK=32, TN=16, TILE_BYTES=320;
struct Args { const int8_t* qa; const float* sa; const float* Sa; const uint8_t* w; const float* bias; float* y; int64_t M,N,K,G,T; };
inline int32_t load4(const int8_t* p){int32_t v; std::memcpy(&v,p,4); return v;}
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
inline void prefetch_ahead(const uint8_t* wg){ for(int c=0;c<5;c++) _mm_prefetch((const char*)(wg+8*TILE_BYTES+64*c), _MM_HINT_T0);}

// V0: current
template <int R, int F=0> TS_AVX512 inline void block_v0(const Args& a, int64_t t, int64_t r0) {
  constexpr int A = R <= 4 ? 2 : 1;
  const uint8_t* wt = a.w + t * a.G * TILE_BYTES;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = wt + g * TILE_BYTES;
    if (a.M >= 5 && r0 == 0) prefetch_ahead(wg);
    __m512i dot[R][A];
    for (int i = 0; i < R; ++i) for (int k = 0; k < A; ++k) dot[i][k] = _mm512_setzero_si512();
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
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg + 288)));
    for (int i = 0; i < R; ++i) {
      const __m512i di = A == 2 ? _mm512_add_epi32(dot[i][0], dot[i][A - 1]) : dot[i][0];
      const __m512 ds = (F & 4) ? d : _mm512_mul_ps(d, _mm512_set1_ps(a.sa[(r0 + i) * a.G + g]));
      const __m512 df = (F & 2) ? _mm512_castsi512_ps(di) : _mm512_cvtepi32_ps(di);
      acc[i] = _mm512_fmadd_ps(df, ds, acc[i]);
      if (!(F & 1)) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.Sa[(r0 + i) * a.G + g]), acc[i]);
    }
  }
  const int64_t o0 = t * TN;
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(a.y + (r0 + i) * a.N + o0, acc[i]);
}
// V1: two tiles x R rows; each broadcast feeds two tiles
template <int R> TS_AVX512 inline void block_v1(const Args& a, int64_t t, int64_t r0) {
  const uint8_t* w0 = a.w + t * a.G * TILE_BYTES;
  const uint8_t* w1 = w0 + a.G * TILE_BYTES;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[2][R];
  for (int i = 0; i < R; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg0 = w0 + g * TILE_BYTES; const uint8_t* wg1 = w1 + g * TILE_BYTES;
    if (PF && r0 == 0) { prefetch_ahead(wg0); prefetch_ahead(wg1);} 
    __m512i dot[2][R];
    for (int i = 0; i < R; ++i) dot[0][i] = dot[1][i] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i r0w = _mm512_loadu_si512(wg0 + 64 * p), r1w = _mm512_loadu_si512(wg1 + 64 * p);
      const __m512i lo0 = _mm512_and_si512(r0w, mask), hi0 = _mm512_and_si512(_mm512_srli_epi16(r0w, 4), mask);
      const __m512i lo1 = _mm512_and_si512(r1w, mask), hi1 = _mm512_and_si512(_mm512_srli_epi16(r1w, 4), mask);
      for (int i = 0; i < R; ++i) {
        const int8_t* xa = a.qa + (r0 + i) * a.K + g * QK + 8 * p;
        const __m512i xl = _mm512_set1_epi32(load4(xa)), xh = _mm512_set1_epi32(load4(xa + 4));
        dot[0][i] = _mm512_dpbusd_epi32(dot[0][i], lo0, xl);
        dot[1][i] = _mm512_dpbusd_epi32(dot[1][i], lo1, xl);
        dot[0][i] = _mm512_dpbusd_epi32(dot[0][i], hi0, xh);
        dot[1][i] = _mm512_dpbusd_epi32(dot[1][i], hi1, xh);
      }
    }
    const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg0 + 256)));
    const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg0 + 288)));
    const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg1 + 256)));
    const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wg1 + 288)));
    for (int i = 0; i < R; ++i) {
      const __m512 s = _mm512_set1_ps(a.sa[(r0 + i) * a.G + g]), S = _mm512_set1_ps(a.Sa[(r0 + i) * a.G + g]);
      acc[0][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0][i]), _mm512_mul_ps(d0, s), acc[0][i]);
      acc[0][i] = _mm512_fmadd_ps(m0, S, acc[0][i]);
      acc[1][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[1][i]), _mm512_mul_ps(d1, s), acc[1][i]);
      acc[1][i] = _mm512_fmadd_ps(m1, S, acc[1][i]);
    }
  }
  for (int i = 0; i < R; ++i) { _mm512_storeu_ps(a.y + (r0 + i) * a.N + t*TN, acc[0][i]); _mm512_storeu_ps(a.y + (r0 + i) * a.N + t*TN + 16, acc[1][i]);}
}
// V2: like v0 but no float work (measure integer-only floor)
template <int R> TS_AVX512 inline void block_v2(const Args& a, int64_t t, int64_t r0) {
  const uint8_t* wt = a.w + t * a.G * TILE_BYTES;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512i dot[R];
  for (int i = 0; i < R; ++i) dot[i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* wg = wt + g * TILE_BYTES;
    if (PF && r0 == 0) prefetch_ahead(wg);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i raw = _mm512_loadu_si512(wg + 64 * p);
      const __m512i lo = _mm512_and_si512(raw, mask);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      for (int i = 0; i < R; ++i) {
        const int8_t* xa = a.qa + (r0 + i) * a.K + g * QK + 8 * p;
        dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(load4(xa)));
        dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(load4(xa + 4)));
      }
    }
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_si512(a.y + (r0 + i) * a.N + t*TN, dot[i]);
}

template<int V, int R> void run_tiles(const Args& a, int64_t t0, int64_t t1);
template<int V, int R> void run_tiles(const Args& a, int64_t t0, int64_t t1) {
  if (V == 1) {
    for (int64_t t = t0; t + 1 < t1; t += 2) for (int64_t r = 0; r + R <= a.M; r += R) block_v1<R>(a, t, r);
    return;
  }
  for (int64_t t = t0; t < t1; ++t) for (int64_t r = 0; r + R <= a.M; r += R) { if (V==0) block_v0<R>(a,t,r); else if (V>=10) block_v0<R, V-10>(a,t,r); else block_v2<R>(a,t,r);} 
}
template<int V, int R> double bench(Args a, int reps) {
  double best=1e9;
  for (int k=0;k<reps;k++){
    auto t0 = std::chrono::steady_clock::now();
    run_tiles<V,R>(a,0,a.T);
    best=std::min(best,std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count());
  }
  return best;
}
TS_AVX512 double dpbusd_per_second() {  // 12 independent chains, the best of 20 short runs
  __m512i acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  const long n = 2000000;
  double best = 1e9;
  for (int trial = 0; trial < 20; trial++) {
    auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
      asm volatile("" : "+v"(w), "+v"(x));
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  int64_t sum = 0;
  for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_epi32(acc[i]);
  return sum == 42 ? 0 : 12.0 * n / best;
}
int main(int argc,char**argv){
  const double peak = dpbusd_per_second();
  printf("VPDPBUSD zmm alone: %.2f G/s = %.0f GMAC/s per core\n", peak / 1e9, 64 * peak / 1e9);
  int64_t shapes[][2]={{960,576},{3072,576},{576,1536},{576,576},{49152,576}};
  int64_t M=atoi(argv[1]);
  std::mt19937 rng(0);
  for (auto& sh: shapes){
    int64_t N=sh[0],K=sh[1],G=K/QK,T=N/TN;
    std::vector<uint8_t> w(T*G*TILE_BYTES); for(auto& b:w) b=rng();
    for(int64_t t=0;t<T;t++)for(int64_t g=0;g<G;g++){ uint16_t* h=(uint16_t*)&w[(t*G+g)*TILE_BYTES+256]; for(int j=0;j<32;j++) h[j]=0x3c00; }
    std::vector<int8_t> qa(M*K); for(auto& b:qa) b=rng()%255-127;
    std::vector<float> sa(M*G,0.01f),Sa(M*G,0.1f), y(M*N);
    Args a{qa.data(),sa.data(),Sa.data(),w.data(),nullptr,y.data(),M,N,K,G,T};
    int reps = std::max<int64_t>(5, 100000000/(N*K));
    double macs=double(M)*N*K;
    auto pr=[&](const char* n,double s){printf("  %-10s %8.1f us  %6.1f GMAC/s\n",n,s*1e6,macs/s/1e9);};
    printf("N=%ld K=%ld M=%ld\n",N,K,M);
    for(int rep=0;rep<1;rep++){
    pr("as shipped R8",bench<0,8>(a,reps)); pr("as shipped R4",bench<0,4>(a,reps));
    pr("2 tiles R4",bench<1,4>(a,reps)); pr("2 tiles R8",bench<1,8>(a,reps));
    pr("no m fma",bench<11,8>(a,reps)); pr("no cvt",bench<12,8>(a,reps)); pr("no d*s mul",bench<14,8>(a,reps));
    pr("no float op",bench<17,8>(a,reps)); pr("integer only",bench<2,8>(a,reps));
    }
  }
}
