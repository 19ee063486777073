// Packed int4 (group-wise) and int8 (per-channel) weights times a few bf16 activation rows, on
// CPUs with AVX512-BF16.
//
// Decode multiplies one to three activation rows by every weight, so the GEMM is a matrix-vector
// product that should run at memory speed. Layout (packed by cpu_gemv.py): rows in blocks of 16,
// and for each block and each pair of input columns (k, k+1) 16 bytes, byte i holding row i's two
// 4-bit codes (k in the low nibble); per block and group, the 16 rows' bf16 scales then zeros. Sixteen output rows then sit in the sixteen fp32 lanes of one
// register: each byte widens to a 32-bit lane, its nibbles become the bf16 pair (128 + q_k,
// 128 + q_k+1) by an OR with 0x43004300 (bf16 holds 128..255 exactly), and one vdpbf16ps
// multiplies the pair by the broadcast (x_k, x_k+1), exactly, summing in fp32. With
// w = (q - 8) * s + z per group (torch's tinygemm convention),
//   sum_k w_k x_k = s * sum_k (128 + q_k) x_k + (z - 136 s) * sum_k x_k,
// so a group costs its dot products plus two FMAs, with the per-group sums of x computed once.
// int8 (w = q * s per row) goes the same way in two nibbles: with u = q + 128 = 16 h + l,
//   sum_k q_k x_k = 16 * sum_k (128 + h_k) x_k + sum_k (128 + l_k) x_k - 2304 * sum_k x_k,
// its layout per block and k-pair being 16 rows x 2 bytes (u_k, u_k+1).

// The kernels below are shared by cpu_gemv.cpp (the ops) and cpu_decode.cpp (the decode stack).

#pragma once

#include "cpu_rows.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define CORE_GEMV_BF16 1
#endif

namespace core_gemv {

#ifdef CORE_GEMV_BF16
// Byte indices for expand4: byte j of pair block u to bytes 4j..4j+3 of w[u] (only the even ones are kept).
struct ExpandIndex {
  alignas(64) uint8_t idx[4][64];
  ExpandIndex() {
    for (int u = 0; u < 4; ++u)
      for (int b = 0; b < 64; ++b) idx[u][b] = static_cast<uint8_t>(16 * u + b / 4);
  }
};
inline const ExpandIndex kExpand;

// Four k-pairs of one row block (64 bytes) -> four registers of 16 bf16 pairs (128 + q_k, 128 + q_k+1).
inline void expand4(const uint8_t* src, __m512i w[4]) {
  const __m512i v = _mm512_loadu_si512(src);
#ifdef __AVX512VBMI__
  // each byte to the low bytes of both halves of its 32-bit lane, the high half shifted right by 4,
  // then (t & 0x000F000F) | 0x43004300 in one ternary-logic op
  const __m512i counts = _mm512_set1_epi32(0x00040000);
  const __m512i lo = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u) {
    const __m512i t = _mm512_srlv_epi16(
        _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, _mm512_load_si512(kExpand.idx[u]), v), counts);
    w[u] = _mm512_ternarylogic_epi32(t, lo, bias, 0xEA);  // (A & B) | C
  }
#else
  const __m512i lo_mask = _mm512_set1_epi32(0x0F), hi_mask = _mm512_set1_epi32(0xF0);
  const __m512i bias = _mm512_set1_epi32(0x43004300);
  for (int u = 0; u < 4; ++u) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, u));
    w[u] = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(b, lo_mask), _mm512_slli_epi32(_mm512_and_si512(b, hi_mask), 12)), bias);
  }
#endif
}

using core_rows::bf16x16;

// Rows [m0, m0 + M) of x times row block nb: out[m, nb*16 .. nb*16+16).
template <int M>
inline void block(const uint8_t* __restrict qw, const uint16_t* __restrict sz, const uint16_t* __restrict x,
                  const float* __restrict xs, uint16_t* __restrict out, int64_t K, int64_t G, int64_t N, int64_t nb) {
  constexpr int C = M == 1 ? 4 : 2;  // independent dot chains per row: enough to hide vdpbf16ps latency
  const int64_t pairs_per_group = K / G / 2, pairs = K / 2;
  const uint8_t* q = qw + nb * pairs * 16;
  const __m512 k136 = _mm512_set1_ps(136.0f);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 a[M][C];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) a[m][c] = _mm512_setzero_ps();
    const int64_t p0 = g * pairs_per_group;
    for (int64_t p = 0; p < pairs_per_group; p += 4) {
      __m512i w[4];
      expand4(q + (p0 + p) * 16, w);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
        for (int m = 0; m < M; ++m) {
          int32_t xp;
          std::memcpy(&xp, x + m * K + 2 * (p0 + p + u), sizeof xp);
          a[m][u % C] = _mm512_dpbf16_ps(a[m][u % C], (__m512bh)w[u], (__m512bh)_mm512_set1_epi32(xp));
        }
    }
    const uint16_t* sg = sz + (nb * G + g) * 32;
    const __m512 s = bf16x16(sg), c = _mm512_fnmadd_ps(k136, s, bf16x16(sg + 16));  // z - 136 s
    for (int m = 0; m < M; ++m) {
      __m512 t = a[m][0];
      for (int j = 1; j < C; ++j) t = _mm512_add_ps(t, a[m][j]);
      acc[m] = _mm512_fmadd_ps(t, s, acc[m]);
      acc[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(xs[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(acc[m]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + nb * 16), r);
  }
}

// Byte indices for int8 expansion: row i of pair block u (bytes 32u + 2i, 32u + 2i + 1) to bytes 4i, 4i + 2.
struct Expand8Index {
  alignas(64) uint8_t idx[2][64];
  Expand8Index() {
    for (int u = 0; u < 2; ++u)
      for (int b = 0; b < 64; ++b) idx[u][b] = static_cast<uint8_t>(32 * u + 2 * (b / 4) + (b % 4 >= 2 ? 1 : 0));
  }
};
inline const Expand8Index kExpand8;

// Two k-pairs of one row block (64 bytes) -> the bf16 pairs (128 + l, ...) and (128 + h, ...) of each.
inline void expand8(const uint8_t* src, __m512i wl[2], __m512i wh[2]) {
  const __m512i v = _mm512_loadu_si512(src);
  const __m512i lo = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
#pragma GCC unroll 2
  for (int u = 0; u < 2; ++u) {
#ifdef __AVX512VBMI__
    const __m512i t = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, _mm512_load_si512(kExpand8.idx[u]), v);
#else
    const __m512i b = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, u));
    const __m512i t = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0xFF)),
                                      _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xFF00)), 8));
#endif
    wl[u] = _mm512_ternarylogic_epi32(t, lo, bias, 0xEA);  // (A & B) | C
    wh[u] = _mm512_or_si512(_mm512_srli_epi16(t, 4), bias);
  }
}

template <int M>
inline void block8(const uint8_t* __restrict qw, const uint16_t* __restrict sc, const uint16_t* __restrict x,
                   const float* __restrict xs, uint16_t* __restrict out, int64_t K, int64_t N, int64_t nb) {
  constexpr int P = M == 1 ? 4 : 2;  // k-pairs per step: one row needs more independent dot chains
  const int64_t pairs = K / 2;
  const uint8_t* q = qw + nb * pairs * 32;
  __m512 al[M][P], ah[M][P];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < P; ++u) al[m][u] = ah[m][u] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += P) {  // K % 8 == 0: whole steps
    __m512i wl[P], wh[P];
#pragma GCC unroll 4
    for (int h = 0; h < P; h += 2) expand8(q + (p + h) * 32, wl + h, wh + h);
#pragma GCC unroll 4
    for (int u = 0; u < P; ++u)
      for (int m = 0; m < M; ++m) {
        int32_t xp;
        std::memcpy(&xp, x + m * K + 2 * (p + u), sizeof xp);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);
        al[m][u] = _mm512_dpbf16_ps(al[m][u], (__m512bh)wl[u], xb);
        ah[m][u] = _mm512_dpbf16_ps(ah[m][u], (__m512bh)wh[u], xb);
      }
  }
  for (int m = 0; m < M; ++m)
    for (int u = 2; u < P; ++u) {
      al[m][u % 2] = _mm512_add_ps(al[m][u % 2], al[m][u]);
      ah[m][u % 2] = _mm512_add_ps(ah[m][u % 2], ah[m][u]);
    }
  const __m512 s = bf16x16(sc + nb * 16);
  for (int m = 0; m < M; ++m) {
    __m512 t = _mm512_fmadd_ps(_mm512_add_ps(ah[m][0], ah[m][1]), _mm512_set1_ps(16.0f), _mm512_add_ps(al[m][0], al[m][1]));
    t = _mm512_fnmadd_ps(_mm512_set1_ps(2304.0f), _mm512_set1_ps(xs[m]), t);
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(t, s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + nb * 16), r);
  }
}


// f(rows as a compile-time constant, first row) over M activation rows: three at a time, then the
// last one or two together (each weight block is read once per call of f).
template <typename F>
inline void for_rows(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) f(std::integral_constant<int, 3>{}, m);
  if (M - m == 2) f(std::integral_constant<int, 2>{}, m);
  if (M - m == 1) f(std::integral_constant<int, 1>{}, m);
}

// One packed weight [N, K]: kind 0 int4 (q codes, s scales then zeros of G groups per row), 1 int8
// (s per-row scales, G = 1); bias (bf16 bits, N) nullptr for none.
struct Weight {
  int64_t kind, N, K, G;
  const uint8_t* q;
  const uint16_t* s;
  const uint16_t* bias = nullptr;
};

// Block nb of w (its 16 output columns) times the M rows of x (xs: their group sums for w.G) into
// out [M, w.N], plus the bias of those columns (rounded as torch's add rounds). The stack's form
// (kernels/cpu_decode.cpp); the ops in cpu_gemv.cpp call block / block8 directly, which measured a
// few per cent faster for them than going through this.
inline void weight_block(const Weight& w, const uint16_t* x, const float* xs, uint16_t* out, int64_t M, int64_t nb) {
  for_rows(M, [&](auto rows, int64_t m) {
    if (w.kind == 0)
      block<rows.value>(w.q, w.s, x + m * w.K, xs + m * w.G, out + m * w.N, w.K, w.G, w.N, nb);
    else
      block8<rows.value>(w.q, w.s, x + m * w.K, xs + m, out + m * w.N, w.K, w.N, nb);
  });
  if (w.bias) {
    using T = c10::BFloat16;
    const T* b = reinterpret_cast<const T*>(w.bias) + nb * 16;
    for (int64_t m = 0; m < M; ++m) {
      T* o = reinterpret_cast<T*>(out + m * w.N + nb * 16);
      core_rows::add_row<T>(o, b, o, 16);
    }
  }
}
#endif

// out[m, g] (fp32, [M, G]): the sums of each row of x [M, K] bf16 over G equal groups of columns.
inline void group_sums(const uint16_t* x, int64_t M, int64_t K, int64_t G, float* out) {
  const int64_t gs = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)  // summed in lanes: a serial chain of adds cost ~4 us per layer at batch 1
      for (int64_t i = 0; i < gs; ++i) {
        const uint32_t bits = static_cast<uint32_t>(x[m * K + g * gs + i]) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof f);
        s += f;
      }
      out[m * G + g] = s;
    }
}

}  // namespace core_gemv
