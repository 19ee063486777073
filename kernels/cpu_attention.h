// The paged-attention kernel of the `cpu` attention backend, shared by its op
// (plugins/attention/cpu_attention.cpp, which says what it computes and how) and by the one-call
// decoder stack (cpu_decode.cpp), which runs its tasks inside its own parallel region.

#pragma once

#include "cpu_rows.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>


namespace core_attention {

constexpr int kBlock = 32;        // keys per block
constexpr int kRowTarget = 48;    // query vectors (tokens x heads of a group) per extend task
constexpr int kChunk = 256;       // keys per chunk of a bf16 decode task
constexpr int kMinPart = 64;      // keys per part, at least, of a decode split over threads
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_f(float x) { return x; }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
inline float to_f(c10::BFloat16 x) { return core_rows::bf16_f(x.x); }  // c10's conversion branches on NaN

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

using core_rows::exp_neg;  // e^x for x <= 0, scalar and on vectors (cpu_rows.h)
#if defined(__AVX2__) && defined(__FMA__)
using core_rows::vexp_neg;
#endif

// Vector helpers where the compiler targets AVX-512 or AVX2 (-march=native decides); elsewhere
// the plain loops below them are used.
#if defined(__AVX512F__)
#include <immintrin.h>
#define CORE_SIMD 16
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CORE_SIMD 8
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline float vhmax(vf x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// q . k where there is no vector unit to tile with (scores_tile serves every -march=native x86 build).
inline float dot(const float* __restrict a, const float* __restrict b, int d) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

// Where the CPU has AVX512-BF16: q . k straight from bf16 rows (products exact, sums in fp32), so
// the keys of a bf16 pool are never converted, and half the multiply instructions.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CORE_BF16_DOT 1

// Lane j of the result = the sum of the 16 lanes of v[j]: a transposing tree of 45 shuffles and
// adds for 16 sums, against ~8 operations for each one reduced alone.
inline __m512 hsum16(const __m512 v[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// A row's c-th 512-bit chunk (32 bf16); where D is an odd number of 16s, its last chunk is half a
// chunk (16 bf16, the rest zeros: those products add nothing).
template <int D>
inline __m512bh chunk_bf16(const c10::BFloat16* p, int c) {
  if constexpr (D % 32 != 0) {
    if (c == D / 32) return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>(0xFFFF), p + 32 * c);
  }
  return (__m512bh)_mm512_loadu_si512(p + 32 * c);
}

// out[j] = scale * (q . k_j) for the n keys at slots idx[0..n), 16 keys per hsum16.
template <int D>
inline void scores_bf16(const c10::BFloat16* __restrict q, const c10::BFloat16* __restrict kc, const int64_t* idx,
                        int n, int64_t slot_stride, int64_t head, float scale, float* __restrict out) {
  static_assert(D % 16 == 0, "whole 256-bit halves of a row");
  constexpr int C = (D + 31) / 32;  // 512-bit chunks of a row (the last one maybe half)
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = chunk_bf16<D>(q, c);
  for (int j0 = 0; j0 < n; j0 += 16) {
    const int m = std::min(16, n - j0);
    __m512 v[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      v[j] = _mm512_setzero_ps();
      if (j < m) {
        const c10::BFloat16* k = kc + idx[j0 + j] * slot_stride + head;
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) v[j] = _mm512_dpbf16_ps(v[j], qv[c], chunk_bf16<D>(k, c));
      }
    }
    _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << m) - 1), _mm512_mul_ps(hsum16(v), _mm512_set1_ps(scale)));
  }
}
#endif

// acc += sum_j p[j] * v[j] over the rows j in [a, z) of v (D floats each); acc stays in registers.
template <int D>
inline void accumulate(float* __restrict acc, const float* __restrict p, const float* __restrict v, int a, int z,
                       int d) {
#ifdef CORE_SIMD
  if constexpr (D > 0 && D % CORE_SIMD == 0) {
    constexpr int N = D / CORE_SIMD;
    vf t[N], u[N];  // two chains (even and odd keys), so consecutive FMAs do not wait on each other
    for (int c = 0; c < N; ++c) {
      t[c] = vload(acc + c * CORE_SIMD);
      u[c] = vzero();
    }
    int j = a;
    for (; j + 1 < z; j += 2) {
      const vf w0 = vset1(p[j]), w1 = vset1(p[j + 1]);
#pragma GCC unroll 8
      for (int c = 0; c < N; ++c) {
        t[c] = vfma(w0, vload(v + j * D + c * CORE_SIMD), t[c]);
        u[c] = vfma(w1, vload(v + (j + 1) * D + c * CORE_SIMD), u[c]);
      }
    }
    if (j < z) {
      const vf w0 = vset1(p[j]);
      for (int c = 0; c < N; ++c) t[c] = vfma(w0, vload(v + j * D + c * CORE_SIMD), t[c]);
    }
    for (int c = 0; c < N; ++c) vstore(acc + c * CORE_SIMD, vadd(t[c], u[c]));
    return;
  }
#endif
  for (int j = a; j < z; ++j) {
    const float w = p[j];
#pragma omp simd
    for (int i = 0; i < d; ++i) acc[i] += w * v[j * d + i];
  }
}

#ifdef CORE_SIMD
// ---- Extends (prefill) with a vector unit: a task's query vectors side by side in the lanes.
// The task's rows (query vectors: tokens x heads of a group, padded to a whole number of vectors)
// are transposed once, qt [D, RP] (scaled), so that for each key of a block the scores of all rows
// are a broadcast-FMA product with the key's row as it lies in the pool: no key is transposed or
// copied (float32 pools), and the scores come out as st [keys, RP], where each row's max, exp and
// sum over the block's keys are lane-wise vector operations.

// A tile of KJ keys x RV vectors of rows of st: st[j][v] = sum_e k_j[e] * qt[e][v].
template <int KJ, int RV>
inline void score_tile(const float* __restrict qt, int RP, int d, const float* const* k, float* __restrict st, int v0) {
  vf acc[KJ][RV];
  for (int j = 0; j < KJ; ++j)
    for (int r = 0; r < RV; ++r) acc[j][r] = vzero();
  for (int e = 0; e < d; ++e) {
    vf qv[RV];
    for (int r = 0; r < RV; ++r) qv[r] = vload(qt + e * RP + (v0 + r) * CORE_SIMD);
#pragma GCC unroll 6
    for (int j = 0; j < KJ; ++j) {
      const vf kb = vset1(k[j][e]);
      for (int r = 0; r < RV; ++r) acc[j][r] = vfma(kb, qv[r], acc[j][r]);
    }
  }
  for (int j = 0; j < KJ; ++j)
    for (int r = 0; r < RV; ++r) vstore(st + j * RP + (v0 + r) * CORE_SIMD, acc[j][r]);
}

// Every row's scores for the n keys whose rows are k[0..n): tiles of 6 keys x 2 vectors of rows
// (12 accumulators, 2 loads of qt and 6 broadcasts per 12 FMAs: AVX2's 16 registers), then the rest.
template <int KJ>
inline void score_keys(const float* qt, int RP, int d, const float* const* k, float* st) {
  const int RV = RP / CORE_SIMD;
  int v = 0;
  for (; v + 2 <= RV; v += 2) score_tile<KJ, 2>(qt, RP, d, k, st, v);
  if (v < RV) score_tile<KJ, 1>(qt, RP, d, k, st, v);
}

inline void scores_t(const float* qt, int RP, int d, const float* const* k, int n, float* st) {
  int j = 0;
  for (; j + 6 <= n; j += 6) score_keys<6>(qt, RP, d, k + j, st + j * RP);
  for (; j + 2 <= n; j += 2) score_keys<2>(qt, RP, d, k + j, st + j * RP);
  if (j < n) score_keys<1>(qt, RP, d, k + j, st + j * RP);
}

// A tile of RR rows x CV vectors of columns (from c0) of acc [rows, d]: acc[r] += sum_j p[j][r] * v_j.
template <int RR, int CV>
inline void weigh_tile(float* __restrict acc, int d, const float* __restrict p, int RP, const float* const* v, int n,
                       int r0, int c0) {
  vf a[RR][CV];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < CV; ++c) a[r][c] = vload(acc + (r0 + r) * d + c0 + c * CORE_SIMD);
  for (int j = 0; j < n; ++j) {
    vf x[CV];
    for (int c = 0; c < CV; ++c) x[c] = vload(v[j] + c0 + c * CORE_SIMD);
#pragma GCC unroll 6
    for (int r = 0; r < RR; ++r) {
      const vf w = vset1(p[j * RP + r0 + r]);
      for (int c = 0; c < CV; ++c) a[r][c] = vfma(w, x[c], a[r][c]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < CV; ++c) vstore(acc + (r0 + r) * d + c0 + c * CORE_SIMD, a[r][c]);
}

// acc[r] += sum_{j < n} p[j][r] * v_j for the rows r < rows (p [n, RP]; v_j the value rows, d a
// multiple of the vector width): tiles of 6 rows x 2 vectors of columns (the V chunks loaded once
// for 6 rows), then the rest.
template <int RR>
inline void weigh_rows(float* acc, int d, const float* p, int RP, const float* const* v, int n, int r0) {
  int c = 0;
  for (; c + 2 * CORE_SIMD <= d; c += 2 * CORE_SIMD) weigh_tile<RR, 2>(acc, d, p, RP, v, n, r0, c);
  if (c < d) weigh_tile<RR, 1>(acc, d, p, RP, v, n, r0, c);
}

inline void weigh_t(float* acc, int rows, int d, const float* p, int RP, const float* const* v, int n) {
  int r = 0;
  for (; r + 6 <= rows; r += 6) weigh_rows<6>(acc, d, p, RP, v, n, r);
  for (; r + 2 <= rows; r += 2) weigh_rows<2>(acc, d, p, RP, v, n, r);
  if (r < rows) weigh_rows<1>(acc, d, p, RP, v, n, r);
}
#endif

// Ask for the K and V rows of keys [from, to) ahead of use: the slots of a sequence are scattered
// page by page, which the hardware prefetchers do not follow.
template <typename T>
inline void prefetch_rows(const T* kc, const T* vc, const int64_t* idx, int from, int to, int64_t slot_stride,
                          int64_t head, int D) {
  for (int j = from; j < to; ++j) {
    const char* k = reinterpret_cast<const char*>(kc + idx[j] * slot_stride + head);
    const char* v = reinterpret_cast<const char*>(vc + idx[j] * slot_stride + head);
    for (int c = 0; c < D * static_cast<int>(sizeof(T)); c += 64) {
      __builtin_prefetch(k + c);
      __builtin_prefetch(v + c);
    }
  }
}

struct Task {
  int b, kvh, r0, nr;
  int64_t cost;
  int part = 0, parts = 1;  // a decode's keys split over `parts` tasks (few sequences, long contexts)
};

struct Params {
  int64_t H, Hkv, G, D, q_stride, out_stride, slot_stride, idx_stride;
  float scale, cap;
  int64_t window;
  const int64_t* idx;
  const int64_t* seq_lens;
  const int64_t* q_start;
  const int64_t* ext;
  float* partial = nullptr;  // [B, parts, H, 2 + D]: each split part's max, sum and unnormalised output
  int parts = 1;
  bool batch_invariant = false;  // (plan's): a decode's token runs as an extend's would
};

// Scratch of one thread, grown to fit the largest task (run_tasks keeps one per thread).
struct Scratch {
  std::vector<float> q, acc, s, kv, m, l, al, ps;
  std::vector<int> lo, hi, a, z;
  std::vector<const float*> kr, vr;  // a block's K and V rows as float (in the pool, or converted in kv)
  void fit(int rows, int nr, int D, int H) {  // H: query heads of a whole-sequence decode task
    const auto grow = [](auto& v, int n) { if (static_cast<int>(v.size()) < n) v.resize(n); };
    const int rp = std::max((rows + 15) / 16 * 16, H);  // rows padded to whole vectors (extend_tiled)
    grow(q, rp * D), grow(acc, rp * D), grow(s, rp * kBlock), grow(kv, kBlock * D);
    grow(m, rp), grow(l, rp), grow(al, rp), grow(ps, H * kChunk);
    grow(lo, nr), grow(hi, nr), grow(a, nr), grow(z, nr), grow(kr, kBlock), grow(vr, kBlock);
  }
};

// The first key a query at position pos attends to: 0, or its window's first.
inline int first_key(const Params& p, int64_t pos) {
  return p.window > 0 ? static_cast<int>(std::max<int64_t>(0, pos - p.window + 1)) : 0;
}

// An extend task's output rows (its tokens x the query heads of its KV head): acc [rows, D] over
// the softmax sums l [rows], in the output's dtype.
template <typename T>
inline void store_rows(const Params& p, const Task& t, const float* acc, const float* l, T* out) {
  const int64_t D = p.D, G = p.G;
  for (int r = 0; r < t.nr; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = r * G + g;
      const float inv = 1.0f / l[row];
      T* dst = out + (p.q_start[t.b] + t.r0 + r) * p.out_stride + (t.kvh * G + g) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[row * D + i] * inv);
    }
}

// The keys [jlo, jhi] a decode at position pos reads (its window's), or this task's part of them
// when its keys are split: whole runs of 16 each (an empty part leaves l = 0).
inline std::pair<int, int> decode_keys(const Params& p, const Task& t, int64_t pos) {
  int jlo = first_key(p, pos);
  int jhi = static_cast<int>(pos);
  if (t.parts > 1) {
    const int span = (((jhi - jlo + 1) + 15) / 16 + t.parts - 1) / t.parts * 16;
    jlo += t.part * span;
    jhi = std::min(jhi, jlo + span - 1);
  }
  return {jlo, jhi};
}

// A split decode's part for merge_parts: each of its QH query heads' (from h0) max, sum and
// unnormalised output (w.m, w.l, w.acc).
inline void store_part(const Params& p, const Task& t, const Scratch& w, int64_t h0, int QH) {
  const int64_t D = p.D;
  float* dst = p.partial + ((t.b * p.parts + t.part) * p.H + h0) * (2 + D);
  for (int g = 0; g < QH; ++g) {
    dst[g * (2 + D)] = w.m[g];
    dst[g * (2 + D) + 1] = w.l[g];
    std::copy(w.acc.begin() + g * D, w.acc.begin() + (g + 1) * D, dst + g * (2 + D) + 2);
  }
}

#ifdef CORE_BF16_DOT
using core_rows::bf16x16;

// acc[g] += sum_j p[g][j] * v_j for GC heads at once (p: [GC, kChunk] probabilities, v_j the bf16
// row at slot idx[j]): each V row is widened to fp32 once and serves every head's accumulators,
// which stay in registers (GC * D / 16 of them).
template <int D, int GC>
inline void weigh_v(const uint16_t* vrows, const int64_t* idx, int n, int64_t slot_stride, const float* p,
                    float* acc) {
  constexpr int N = D / 16;
  constexpr int S = GC * N < 8 ? 2 : 1;  // accumulator sets (even and odd keys) so that 8+ FMAs are in flight
  __m512 a[S][GC][N];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < N; ++c) {
      a[0][g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
      if constexpr (S == 2) a[S - 1][g][c] = _mm512_setzero_ps();
    }
  int j = 0;
  for (; j + S <= n; j += S) {
#pragma GCC unroll 2
    for (int u = 0; u < S; ++u) {
      const uint16_t* v = vrows + idx[j + u] * slot_stride;
      __m512 x[N];
#pragma GCC unroll 8
      for (int c = 0; c < N; ++c) x[c] = bf16x16(v + 16 * c);
#pragma GCC unroll 4
      for (int g = 0; g < GC; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * kChunk + j + u]);
#pragma GCC unroll 8
        for (int c = 0; c < N; ++c) a[u][g][c] = _mm512_fmadd_ps(w, x[c], a[u][g][c]);
      }
    }
  }
  for (; j < n; ++j) {
    const uint16_t* v = vrows + idx[j] * slot_stride;
    for (int g = 0; g < GC; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * kChunk + j]);
      for (int c = 0; c < N; ++c) a[0][g][c] = _mm512_fmadd_ps(w, bf16x16(v + 16 * c), a[0][g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < N; ++c)
      _mm512_storeu_ps(acc + g * D + 16 * c, S == 2 ? _mm512_add_ps(a[0][g][c], a[S - 1][g][c]) : a[0][g][c]);
}

// One query token (row qi of q, at position pos) over a bf16 pool, no soft cap, for the G query
// heads of the task's KV head, or of every KV head when t.kvh < 0 (whole slot rows read together).
// Decodes run it once; extend tasks once per token, their keys staying in cache. In chunks of up
// to kChunk keys: first every score of the chunk for each head (hsum16 per 16 keys), then one max,
// exp and sum per head over the whole chunk (vector loops, no reduction per 16 keys), then the V
// rows weighted into each head's accumulators held in registers. Online softmax only between
// chunks, so a long sequence needs no more scratch than kChunk keys.
template <int D>
void decode_bf16(const Params& p, const Task& t, const c10::BFloat16* q, const c10::BFloat16* kc,
                 const c10::BFloat16* vc, c10::BFloat16* out, Scratch& w, int64_t pos, int64_t qi) {
  constexpr int N = D / 16;
  const int G = static_cast<int>(p.G);
  const int h0 = t.kvh < 0 ? 0 : t.kvh, nh = t.kvh < 0 ? static_cast<int>(p.Hkv) : 1;  // the task's KV heads
  const int QH = nh * G;  // and query heads
  const int64_t* idx = p.idx + t.b * p.idx_stride;
  const auto [jlo, jhi] = decode_keys(p, t, pos);
  float* acc = w.acc.data();
  float* sc = w.ps.data();  // [QH, kChunk] scores, then probabilities
  std::fill(acc, acc + QH * D, 0.0f);
  const c10::BFloat16* qrow = q + qi * p.q_stride + h0 * G * D;
  for (int g = 0; g < QH; ++g) {
    w.m[g] = kNegInf;  // the first chunk's max replaces it: every chunk has a live (finite) score
    w.l[g] = 0.0f;
  }
  for (int c0 = jlo; c0 <= jhi; c0 += kChunk) {
    const int n = std::min(kChunk, jhi - c0 + 1);
    const int per = (16 + QH - 1) / QH;  // keys prefetched per head's scores: a steady stream, not a burst
    for (int j0 = 0; j0 < n; j0 += 16) {  // K rows 16 keys ahead (V rows with them)
      for (int g = 0; g < QH; ++g) {
        const int f = c0 + j0 + 16 + g * per;
        prefetch_rows(kc, vc, idx, std::min(f, jhi + 1), std::min({f + per, c0 + j0 + 32, jhi + 1}), p.slot_stride,
                      h0 * D, nh * D);
        scores_bf16<D>(qrow + g * D, kc, idx + c0 + j0, std::min(16, n - j0), p.slot_stride, (h0 + g / G) * D,
                       p.scale, sc + g * kChunk + j0);
      }
    }
    const int nv = n & ~15;  // whole vectors; the tail is masked
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - nv)) - 1);
    for (int g = 0; g < QH; ++g) {
      float* s = sc + g * kChunk;
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int j = 0; j < nv; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
      if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + nv));
      const float mnew = std::max(w.m[g], _mm512_reduce_max_ps(mx));
      const float alpha = std::exp(w.m[g] - mnew);
      const __m512 mv = _mm512_set1_ps(mnew);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < nv; j += 16) {
        const __m512 e = vexp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (tail) {
        const __m512 e = _mm512_maskz_mov_ps(tail, vexp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + nv), mv)));
        _mm512_mask_storeu_ps(s + nv, tail, e);
        sum = _mm512_add_ps(sum, e);
      }
      w.l[g] = w.l[g] * alpha + _mm512_reduce_add_ps(sum);
      w.m[g] = mnew;
      const __m512 av = _mm512_set1_ps(alpha);
      for (int c = 0; c < N; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, _mm512_mul_ps(av, _mm512_loadu_ps(acc + g * D + 16 * c)));
    }
    for (int h = 0; h < nh; ++h) {
      const uint16_t* vrows = reinterpret_cast<const uint16_t*>(vc + (h0 + h) * D);
      float *ph = sc + h * G * kChunk, *ah = acc + h * G * D;
      switch (D <= 64 ? G : D == 128 ? G + 8 : 0) {  // all G heads' accumulators fit in registers
        case 1: weigh_v<D, 1>(vrows, idx + c0, n, p.slot_stride, ph, ah); break;
        case 2: weigh_v<D, 2>(vrows, idx + c0, n, p.slot_stride, ph, ah); break;
        case 3: weigh_v<D, 3>(vrows, idx + c0, n, p.slot_stride, ph, ah); break;
        case 4: weigh_v<D, 4>(vrows, idx + c0, n, p.slot_stride, ph, ah); break;
        case 9: weigh_v<D, 1>(vrows, idx + c0, n, p.slot_stride, ph, ah); break;
        case 10: weigh_v<D, 2>(vrows, idx + c0, n, p.slot_stride, ph, ah); break;
        default:
          for (int g = 0; g < G; ++g)
            weigh_v<D, 1>(vrows, idx + c0, n, p.slot_stride, ph + g * kChunk, ah + g * D);
      }
    }
  }
  if (t.parts > 1) {  // merged with the other parts after all tasks ran (merge_parts)
    store_part(p, t, w, h0 * G, QH);
    return;
  }
  c10::BFloat16* dst = out + qi * p.out_stride + h0 * G * D;
  for (int g = 0; g < QH; ++g) {
    const float inv = 1.0f / w.l[g];
    for (int i = 0; i < D; ++i) dst[g * D + i] = static_cast<c10::BFloat16>(acc[g * D + i] * inv);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define CORE_F32_DECODE 1
// ---- The same per-token decode for a float32 pool on AVX2 (what --dtype auto picks on CPUs without
// native bf16): 8 lanes, 16 registers, no masks. Scores 8 keys per hsum8; the V rows weighted into
// accumulators held in registers, in passes over parts of D when the heads' accumulators would not
// fit in 16 registers.

// Lane j of the result = the sum of the 8 lanes of v[j].
inline __m256 hsum8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 | v0..v3] halves, v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[j] = scale * (q . k_j) for the n keys at slots idx[0..n), 8 keys per hsum8 (q from L1, each
// key's chunks straight from the pool).
template <int D>
inline void scores_f32(const float* __restrict q, const float* __restrict kc, const int64_t* idx, int n,
                       int64_t slot_stride, int64_t head, float scale, float* __restrict out) {
  for (int j0 = 0; j0 < n; j0 += 8) {
    const int m = std::min(8, n - j0);
    __m256 v[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      v[j] = _mm256_setzero_ps();
      if (j < m) {
        const float* k = kc + idx[j0 + j] * slot_stride + head;
#pragma GCC unroll 16
        for (int c = 0; c < D; c += 8) v[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), v[j]);
      }
    }
    const __m256 r = _mm256_mul_ps(hsum8(v), _mm256_set1_ps(scale));
    if (m == 8) {
      _mm256_storeu_ps(out + j0, r);
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, r);
      std::copy(t, t + m, out + j0);
    }
  }
}

// acc[g] += sum_j p[g][j] * v_j for GC heads (p: [GC, kChunk]) over columns [c0, c0 + 8 CP) of the
// float rows v_j at slot idx[j]: GC * CP accumulators in registers, each V chunk loaded once per head
// (from L1 after the first).
template <int CP, int GC>
inline void weigh_v_f32(const float* vrows, const int64_t* idx, int n, int64_t slot_stride, const float* p,
                        float* acc, int D, int c0) {
  __m256 a[GC][CP];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < CP; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + c0 + 8 * c);
  for (int j = 0; j < n; ++j) {
    const float* v = vrows + idx[j] * slot_stride + c0;
#pragma GCC unroll 4
    for (int g = 0; g < GC; ++g) {
      const __m256 w = _mm256_set1_ps(p[g * kChunk + j]);
#pragma GCC unroll 8
      for (int c = 0; c < CP; ++c) a[g][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * c), a[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < CP; ++c) _mm256_storeu_ps(acc + g * D + c0 + 8 * c, a[g][c]);
}

// All of D for GC heads: passes of CP chunks, GC * CP <= 12 accumulators.
template <int D, int GC>
inline void weigh_v_f32_all(const float* vrows, const int64_t* idx, int n, int64_t slot_stride, const float* p,
                            float* acc) {
  constexpr int chunks = D / 8;
  constexpr int fit = 12 / GC;
  constexpr int CP = fit >= chunks ? chunks : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;  // a divisor of chunks
  for (int c0 = 0; c0 < D; c0 += 8 * CP) weigh_v_f32<CP, GC>(vrows, idx, n, slot_stride, p, acc, D, c0);
}

// decode_bf16 for a float32 pool (see there): one query token over the keys of the task's KV head,
// or of every KV head when t.kvh < 0; chunks of up to kChunk keys, online softmax between chunks.
template <int D>
void decode_f32(const Params& p, const Task& t, const float* q, const float* kc, const float* vc, float* out, Scratch& w,
                int64_t pos, int64_t qi) {
  const int G = static_cast<int>(p.G);
  const int h0 = t.kvh < 0 ? 0 : t.kvh, nh = t.kvh < 0 ? static_cast<int>(p.Hkv) : 1;
  const int QH = nh * G;
  const int64_t* idx = p.idx + t.b * p.idx_stride;
  const auto [jlo, jhi] = decode_keys(p, t, pos);
  float* acc = w.acc.data();
  float* sc = w.ps.data();  // [QH, kChunk] scores, then probabilities
  std::fill(acc, acc + QH * D, 0.0f);
  const float* qrow = q + qi * p.q_stride + h0 * G * D;
  for (int g = 0; g < QH; ++g) {
    w.m[g] = kNegInf;
    w.l[g] = 0.0f;
  }
  for (int c0 = jlo; c0 <= jhi; c0 += kChunk) {
    const int n = std::min(kChunk, jhi - c0 + 1);
    const int per = (8 + QH - 1) / QH;  // keys prefetched per head's scores
    for (int j0 = 0; j0 < n; j0 += 8) {
      for (int g = 0; g < QH; ++g) {
        const int f = c0 + j0 + 8 + g * per;
        prefetch_rows(kc, vc, idx, std::min(f, jhi + 1), std::min({f + per, c0 + j0 + 16, jhi + 1}), p.slot_stride,
                      h0 * D, nh * D);
        scores_f32<D>(qrow + g * D, kc, idx + c0 + j0, std::min(8, n - j0), p.slot_stride, (h0 + g / G) * D, p.scale,
                      sc + g * kChunk + j0);
      }
    }
    const int nv = n & ~7;
    for (int g = 0; g < QH; ++g) {
      float* s = sc + g * kChunk;
      __m256 mx = _mm256_set1_ps(kNegInf);
      for (int j = 0; j < nv; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
      alignas(32) float t8[8];
      _mm256_store_ps(t8, mx);
      float bmax = *std::max_element(t8, t8 + 8);
      for (int j = nv; j < n; ++j) bmax = std::max(bmax, s[j]);
      const float mnew = std::max(w.m[g], bmax);
      const float alpha = std::exp(w.m[g] - mnew);
      const __m256 mv = _mm256_set1_ps(mnew);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < nv; j += 8) {
        const __m256 e = vexp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_store_ps(t8, sum);
      float total = 0.0f;
      for (int j = 0; j < 8; ++j) total += t8[j];
      for (int j = nv; j < n; ++j) {
        s[j] = exp_neg(s[j] - mnew);
        total += s[j];
      }
      w.l[g] = w.l[g] * alpha + total;
      w.m[g] = mnew;
      if (alpha != 1.0f) {
        const __m256 av = _mm256_set1_ps(alpha);
        for (int c = 0; c < D; c += 8) _mm256_storeu_ps(acc + g * D + c, _mm256_mul_ps(av, _mm256_loadu_ps(acc + g * D + c)));
      }
    }
    for (int h = 0; h < nh; ++h) {
      const float* vrows = vc + (h0 + h) * D;
      float *ph = sc + h * G * kChunk, *ah = acc + h * G * D;
      int g = 0;
      for (; g + 4 <= G; g += 4) weigh_v_f32_all<D, 4>(vrows, idx + c0, n, p.slot_stride, ph + g * kChunk, ah + g * D);
      switch (G - g) {
        case 3: weigh_v_f32_all<D, 3>(vrows, idx + c0, n, p.slot_stride, ph + g * kChunk, ah + g * D); break;
        case 2: weigh_v_f32_all<D, 2>(vrows, idx + c0, n, p.slot_stride, ph + g * kChunk, ah + g * D); break;
        case 1: weigh_v_f32_all<D, 1>(vrows, idx + c0, n, p.slot_stride, ph + g * kChunk, ah + g * D); break;
        default: break;
      }
    }
  }
  if (t.parts > 1) {  // merged with the other parts after all tasks ran (merge_parts)
    store_part(p, t, w, h0 * G, QH);
    return;
  }
  float* dst = out + qi * p.out_stride + h0 * G * D;
  for (int g = 0; g < QH; ++g) {
    const float inv = 1.0f / w.l[g];
    for (int i = 0; i < D; ++i) dst[g * D + i] = acc[g * D + i] * inv;
  }
}
#endif

#ifdef CORE_SIMD
// One extend task (tokens r0 .. r0 + nr of sequence b, the query heads of KV head kvh) with the
// rows side by side in the lanes (see score_tile): per block of keys, st = the scores of every row,
// the causal (and window) mask only on blocks that reach past the first token's position, the
// online softmax lane-wise, then the probabilities times the V rows. The running max starts at
// -1e30, not -inf, so a row with no key yet in a block (a window's start) never computes -inf - -inf.
template <typename T, int DC>
void extend_tiled(const Params& p, const Task& t, const T* q, const T* kc, const T* vc, T* out, Scratch& w) {
  const int D = DC > 0 ? DC : static_cast<int>(p.D), G = static_cast<int>(p.G);
  const int rows = t.nr * G, RP = (rows + CORE_SIMD - 1) / CORE_SIMD * CORE_SIMD;
  const int64_t first = p.seq_lens[t.b] - p.ext[t.b] + t.r0;  // position of the task's first token
  const int64_t* idx = p.idx + t.b * p.idx_stride;
  const int64_t head = t.kvh * D;
  const int jlo = first_key(p, first), jhi = static_cast<int>(first + t.nr - 1), lo_last = first_key(p, jhi);
  float *qt = w.q.data(), *acc = w.acc.data(), *st = w.s.data(), *m = w.m.data(), *l = w.l.data(), *al = w.al.data();
  std::fill(qt, qt + D * RP, 0.0f);
  for (int r = 0; r < t.nr; ++r)
    for (int g = 0; g < G; ++g) {
      const T* src = q + (p.q_start[t.b] + t.r0 + r) * p.q_stride + (t.kvh * G + g) * D;
      for (int e = 0; e < D; ++e) qt[e * RP + r * G + g] = to_f(src[e]) * p.scale;
    }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + RP, -1e30f);
  std::fill(l, l + RP, 0.0f);
  const auto rows_of = [&](const T* cache, int j0, int n, const float** ptr) {
    for (int j = 0; j < n; ++j) {
      const T* row = cache + idx[j0 + j] * p.slot_stride + head;
      if constexpr (std::is_same_v<T, float>) {
        ptr[j] = row;
      } else {
        load_row(row, w.kv.data() + j * D, D);
        ptr[j] = w.kv.data() + j * D;
      }
    }
  };
  prefetch_rows(kc, vc, idx, jlo, std::min(jlo + kBlock, jhi + 1), p.slot_stride, head, D);
  for (int j0 = jlo; j0 <= jhi; j0 += kBlock) {
    const int n = std::min(kBlock, jhi - j0 + 1);
    prefetch_rows(kc, vc, idx, j0 + kBlock, std::min(j0 + 2 * kBlock, jhi + 1), p.slot_stride, head, D);
    rows_of(kc, j0, n, w.kr.data());
    scores_t(qt, RP, D, w.kr.data(), n, st);
    if (p.cap > 0.0f)
      for (int i = 0; i < n * RP; ++i) st[i] = p.cap * std::tanh(st[i] / p.cap);
    if (j0 + n - 1 > first || j0 < lo_last) {  // some key of the block lies outside some row's range
      for (int j = 0; j < n; ++j)
        for (int r = 0; r < rows; ++r) {
          const int64_t pos = first + r / G;
          if (j0 + j > pos || j0 + j < first_key(p, pos)) st[j * RP + r] = kNegInf;
        }
    }
    for (int v = 0; v < RP; v += CORE_SIMD) {  // the online softmax, CORE_SIMD rows at a time
      vf mx = vload(m + v);
      for (int j = 0; j < n; ++j) mx = vmax(mx, vload(st + j * RP + v));
      const vf alpha = vexp_neg(vsub(vload(m + v), mx));
      vf sum = vzero();
      for (int j = 0; j < n; ++j) {
        const vf e = vexp_neg(vsub(vload(st + j * RP + v), mx));
        vstore(st + j * RP + v, e);
        sum = vadd(sum, e);
      }
      vstore(l + v, vfma(vload(l + v), alpha, sum));
      vstore(m + v, mx);
      vstore(al + v, alpha);
    }
    for (int r = 0; r < rows; ++r) {
      if (al[r] == 1.0f) continue;
      const vf a = vset1(al[r]);
      for (int c = 0; c < D; c += CORE_SIMD) vstore(acc + r * D + c, vmul(vload(acc + r * D + c), a));
    }
    rows_of(vc, j0, n, w.vr.data());
    weigh_t(acc, rows, D, st, RP, w.vr.data(), n);
  }
  store_rows(p, t, acc, l, out);
}
#endif

template <typename T, int DC>
void run_task(const Params& p, const Task& t, const T* q, const T* kc, const T* vc, T* out, Scratch& w) {
#ifdef CORE_F32_DECODE
  if constexpr (std::is_same_v<T, float> && (DC == 64 || DC == 128)) {
    if (p.cap == 0.0f && p.G <= 16 && p.ext[t.b] == 1 && !p.batch_invariant) {  // a decode (extends: tiled blocks)
      const int64_t first = p.seq_lens[t.b] - p.ext[t.b] + t.r0;
      for (int r = 0; r < t.nr; ++r) decode_f32<DC>(p, t, q, kc, vc, out, w, first + r, p.q_start[t.b] + t.r0 + r);
      return;
    }
  }
#endif
#ifdef CORE_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16> && (DC == 16 || DC == 32 || DC == 64 || DC == 128)) {
    if (p.cap == 0.0f && p.G <= 16) {  // each query token on its own (the task's keys stay in cache)
      const int64_t first = p.seq_lens[t.b] - p.ext[t.b] + t.r0;
      for (int r = 0; r < t.nr; ++r) decode_bf16<DC>(p, t, q, kc, vc, out, w, first + r, p.q_start[t.b] + t.r0 + r);
      return;
    }
  }
#endif
#ifdef CORE_SIMD
  if ((DC > 0 ? DC : p.D) % CORE_SIMD == 0) return extend_tiled<T, DC>(p, t, q, kc, vc, out, w);
#endif
  const int D = DC > 0 ? DC : static_cast<int>(p.D), G = static_cast<int>(p.G);
  const int rows = t.nr * G;
  const int64_t first = p.seq_lens[t.b] - p.ext[t.b] + t.r0;  // position of the task's first query
  const int64_t* idx = p.idx + t.b * p.idx_stride;
  const int64_t head = t.kvh * D;
  const int jlo = first_key(p, first), jhi = static_cast<int>(first + t.nr - 1);
  prefetch_rows(kc, vc, idx, jlo, std::min(jlo + kBlock, jhi + 1), p.slot_stride, head, D);
  float *qb = w.q.data(), *acc = w.acc.data(), *s = w.s.data(), *kv = w.kv.data();
  for (int r = 0; r < t.nr; ++r) {
    const int64_t pos = first + r;
    w.hi[r] = static_cast<int>(pos);
    w.lo[r] = first_key(p, pos);
    for (int g = 0; g < G; ++g) {
      const T* src = q + (p.q_start[t.b] + t.r0 + r) * p.q_stride + (t.kvh * G + g) * D;
      float* dst = qb + (r * G + g) * D;
      load_row(src, dst, D);
      for (int i = 0; i < D; ++i) dst[i] *= p.scale;
    }
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  for (int j0 = jlo; j0 <= jhi; j0 += kBlock) {
    const int n = std::min(kBlock, jhi - j0 + 1);
    prefetch_rows(kc, vc, idx, j0 + kBlock, std::min(j0 + 2 * kBlock, jhi + 1), p.slot_stride, head, D);
    for (int j = 0; j < n; ++j) load_row(kc + idx[j0 + j] * p.slot_stride + head, kv + j * D, D);
    for (int r = 0; r < t.nr; ++r) {  // scores, then the online-softmax update, per query vector
      w.a[r] = std::max(w.lo[r] - j0, 0);
      w.z[r] = std::min(w.hi[r] - j0 + 1, n);
      const int a = w.a[r], z = w.z[r];
      if (a >= z) continue;
      for (int g = 0; g < G; ++g) {
        const int row = r * G + g;
        float* sr = s + row * kBlock;
        float bmax = kNegInf;
        for (int j = a; j < z; ++j) sr[j] = dot(qb + row * D, kv + j * D, D);
        if (p.cap > 0.0f) {
          for (int j = a; j < z; ++j) sr[j] = p.cap * std::tanh(sr[j] / p.cap);
        }
        {
          int j = a;
#ifdef CORE_SIMD
          if (z - a >= CORE_SIMD) {
            vf vm = vload(sr + j);
            for (j += CORE_SIMD; j + CORE_SIMD <= z; j += CORE_SIMD) vm = vmax(vm, vload(sr + j));
            bmax = vhmax(vm);
          }
#endif
          for (; j < z; ++j) bmax = std::max(bmax, sr[j]);
        }
        const float mnew = std::max(w.m[row], bmax);
        const float alpha = w.m[row] == kNegInf ? 0.0f : exp_neg(w.m[row] - mnew);
        float sum = 0.0f;
        int j = a;
#ifdef CORE_SIMD
        {  // whole vectors (exp_neg's scalar form does not vectorise), then the tail
          vf vs = vzero();
          const vf mv = vset1(mnew);
          for (; j + CORE_SIMD <= z; j += CORE_SIMD) {
            const vf e = vexp_neg(vsub(vload(sr + j), mv));
            vstore(sr + j, e);
            vs = vadd(vs, e);
          }
          sum = vsum(vs);
        }
#endif
        for (; j < z; ++j) {
          sr[j] = exp_neg(sr[j] - mnew);
          sum += sr[j];
        }
        w.l[row] = w.l[row] * alpha + sum;
        w.m[row] = mnew;
        if (alpha != 1.0f) {
          float* ar = acc + row * D;
          for (int i = 0; i < D; ++i) ar[i] *= alpha;
        }
      }
    }
    for (int j = 0; j < n; ++j) load_row(vc + idx[j0 + j] * p.slot_stride + head, kv + j * D, D);
    for (int r = 0; r < t.nr; ++r) {
      for (int g = 0; g < G; ++g) {
        const int row = r * G + g;
        const float* sr = s + row * kBlock;
        float* ar = acc + row * D;
        accumulate<DC>(ar, sr, kv, w.a[r], w.z[r], D);
      }
    }
  }
  store_rows(p, t, acc, w.l.data(), out);
}

// out for the decodes whose keys were split: the parts' outputs weighted by e^(m_part - m) and
// divided by the parts' summed softmax denominators (a part with no keys has m = -inf, l = 0).
template <typename T>
void merge_parts(const Params& p, const std::vector<Task>& tasks, T* out) {
  const int D = static_cast<int>(p.D);
  std::vector<float> acc(D);
  for (const Task& t : tasks) {
    if (t.parts <= 1 || t.part != 0) continue;
    const int64_t h0 = t.kvh < 0 ? 0 : t.kvh * p.G, nh = t.kvh < 0 ? p.H : p.G;  // the task's query heads
    T* dst = out + p.q_start[t.b] * p.out_stride;
    for (int64_t h = h0; h < h0 + nh; ++h) {
      const auto part = [&](int k) { return p.partial + ((t.b * p.parts + k) * p.H + h) * (2 + D); };
      float m = kNegInf, l = 0.0f;
      for (int k = 0; k < t.parts; ++k) m = std::max(m, part(k)[0]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int k = 0; k < t.parts; ++k) {
        const float* r = part(k);
        if (r[1] == 0.0f) continue;
        const float f = std::exp(r[0] - m);
        l += r[1] * f;
        for (int i = 0; i < D; ++i) acc[i] += r[2 + i] * f;
      }
      for (int i = 0; i < D; ++i) dst[h * D + i] = static_cast<T>(acc[i] / l);
    }
  }
}

#ifdef CORE_BF16_DOT
constexpr bool kDecodeBf16 = true;  // decode_bf16 exists (it takes whole-sequence tasks)
#else
constexpr bool kDecodeBf16 = false;
#endif
#ifdef CORE_F32_DECODE
constexpr bool kDecodeF32 = true;  // decode_f32 exists (likewise)
#else
constexpr bool kDecodeF32 = false;
#endif

// One batch's tasks and what they read: planned once per batch (every layer of a step has the
// same); the vectors own what the Params point to.
struct Work {
  Params p{};
  std::vector<Task> tasks;
  std::vector<int64_t> q_start;
  std::vector<float> partial;
  int max_nr = 1;
};

// Checks the batch's layout (B sequences: seq_lens sl, extend_lens el, slot rows idx of
// idx_width slots at idx_stride; q of q_rows rows at q_stride) and plans its tasks for nthreads.
// batch_invariant (--enable-deterministic-inference): every token computed as an extend computes
// it (a float32 decode too, not by decode_f32), its keys never split, so that a row's result follows
// neither the batch's size nor whether its token came in a prefill, a chunk of one or a decode.
inline void plan(Work& w, int64_t B, const int64_t* sl, const int64_t* el, const int64_t* idx, int64_t idx_stride,
                 int64_t idx_width, int64_t q_rows, int64_t q_stride, int64_t H, int64_t Hkv, int64_t D,
                 at::ScalarType dtype, double scale, int64_t window, double cap, int64_t nthreads,
                 bool batch_invariant = false) {
  const int64_t G = H / Hkv;
  std::vector<int64_t>& q_start = w.q_start;
  q_start.assign(B, 0);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(el[b] >= 1 && el[b] <= sl[b] && sl[b] <= idx_width, "sequence ", b, ": extend_len ", el[b],
                ", seq_len ", sl[b], " do not fit the slot table");
    q_start[b] = total;
    total += el[b];
  }
  TORCH_CHECK(total == q_rows, "q has ", q_rows, " rows, extend_lens sum to ", total);
  const int rows_per_task = static_cast<int>(std::max<int64_t>(1, kRowTarget / G));
  // Decodes of a bf16 (float32) pool run decode_bf16 (decode_f32), one task per sequence when there
  // are enough of them for the threads: reading a slot's K (V) rows of all heads together streams
  // ~30 % faster than one head's rows.
  // (head dims of 16 and 32: bf16 only; decode_f32 would round differently from the extends' tiled
  // blocks, which the same token computed by a prefill, e.g. after a retraction, must match)
  const bool vec_path = !batch_invariant && cap == 0.0 && G <= 16 &&
                        ((dtype == at::kBFloat16 && kDecodeBf16 && (D == 16 || D == 32 || D == 64 || D == 128)) ||
                         (dtype == at::kFloat && kDecodeF32 && (D == 64 || D == 128)));
  const bool whole_seqs = vec_path && B >= 4 * nthreads;
  // With fewer decode tasks than two per thread (a few sequences), each decode reads whole slot rows
  // too, its keys split into up to this many parts of kMinPart keys or more (one per thread at
  // batch 1: more parts measured slower), merged afterwards, so that every thread has work. At
  // batch 1, SmolLM2's 3 KV heads as 3 tasks kept one of 2 threads waiting for a third of the
  // attention's time (30 layers at ~256 keys: 308 -> 230 us per step on 2 threads).
  const bool few = vec_path && B * Hkv < 2 * nthreads;
  const int64_t split = few ? (nthreads + B - 1) / B : 1;
  std::vector<Task>& tasks = w.tasks;
  tasks.clear();
  int max_nr = 1;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r0 = 0; r0 < el[b]; r0 += rows_per_task) {
      const int nr = static_cast<int>(std::min<int64_t>(rows_per_task, el[b] - r0));
      const int64_t last = sl[b] - el[b] + r0 + nr;  // keys the task reads, at most
      const int64_t keys = window > 0 ? std::min<int64_t>(last, window + nr) : last;
      max_nr = std::max(max_nr, nr);
      if ((whole_seqs || few) && el[b] == 1) {  // tasks reading whole slot rows (every KV head) of its sequence
        const int parts = static_cast<int>(std::clamp<int64_t>(keys / kMinPart, 1, split));
        for (int k = 0; k < parts; ++k) tasks.push_back({int(b), -1, int(r0), nr, keys * Hkv / parts, k, parts});
        continue;
      }
      for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({int(b), int(h), int(r0), nr, keys * nr});
    }
  }
  // longest first, so that dynamic scheduling ends with short tasks
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  w.max_nr = max_nr;
  w.partial.assign(split > 1 ? B * split * H * (2 + D) : 0, 0.0f);
  w.p = Params{H, Hkv, G, D, q_stride, H * D, Hkv * D, idx_stride, static_cast<float>(scale), static_cast<float>(cap),
               window, idx, sl, q_start.data(), el};
  w.p.partial = w.partial.data();
  w.p.parts = static_cast<int>(split);
  w.p.batch_invariant = batch_invariant;
}

// Inside a parallel region, every thread: a share of the tasks (dynamically scheduled, longest
// first), then, where decodes were split, one thread merging their parts; the threads leave in step.
template <typename T, int DC>
void run_tasks(const Work& w, const T* q, const T* kc, const T* vc, T* out) {
  thread_local Scratch s;  // each thread keeps its own between calls, as between the tasks of a call
  s.fit(w.max_nr * static_cast<int>(w.p.G), w.max_nr, static_cast<int>(w.p.D), static_cast<int>(w.p.H));
  const int64_t n = static_cast<int64_t>(w.tasks.size());
#pragma omp for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) run_task<T, DC>(w.p, w.tasks[i], q, kc, vc, out, s);
  if (w.p.parts > 1) {
#pragma omp single
    merge_parts<T>(w.p, w.tasks, out);
  }
}

}  // namespace core_attention
