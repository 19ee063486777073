// Packed int4 (group-wise) and int8 (per-channel) weights times a few bf16 activation rows, on
// CPUs with AVX512-BF16 and AVX512-VNNI (every CPU with the first has the second).
//
// A decode of a few sequences multiplies a few activation rows by every weight, so the GEMM is a
// matrix-vector product that should run at memory speed. As llama.cpp does with its quantized
// blocks, each activation row is quantized to int8 per run of 32 columns (quantize_rows: codes xq
// and one fp32 scale d per run), and vpdpbusd multiplies 4 unsigned weight codes by 4 codes of x in
// each 32-bit lane, summing exactly in int32; sixteen output rows sit in the sixteen lanes of one
// register.
// The product is exactly that of the weight and the quantized row d * xq: quantizing costs each
// output at most ~0.4 % of the runs' largest |x| times |w|, and lets the kernels read their
// weights at the memory's speed, where the exact bf16 dot products (vdpbf16ps, with a byte
// permute and an OR to widen each pair of codes) were bound by their own rate (SmolLM2's layers,
// Zen 5, two cores: ~82 GB/s in the decode stack against ~67).
//
// int4, rows in blocks of 16 (packed by cpu_gemv.py): per block and 8 input columns 64 bytes,
// byte 4 i + j holding row i's code of column j in its low nibble and of column j + 4 in its high
// one (a mask and a shift make the two operands); per block and group, the 16 rows' scales s, then
// their offsets. With w = q s + m per group (m = z - 8 s for torch's tinygemm convention
// w = (q - 8) s + z; GGUF's Q4_0 and Q4_1 store exactly s and m),
//   sum_k w_k x_k = s * sum_runs d * sum_k q_k xq_k + m * sum_runs d * sum_k xq_k.
// bf16 activations keep s and the tinygemm zero z in bf16, and the kernel forms m = z - 8 s in fp32:
// exact for weights whose s and z are bf16 (torchao's int4 and the checkpoints packed as such),
// where a bf16 m rounds z - 8 s (with it, test_quant_kernels' int4 GEMMs missed their 1.56 % bound).
// Float32 activations keep s and m in fp16 (F16C widens them; 4 bytes a group of 32, where fp32
// took 8 and made a third of SmolLM2's int4 bytes; GGUF's fp16 d and m stay exact).
// int8 (w = q * s per row), stored as u = q + 128: per block and 4 columns 64 bytes, byte 4 i + j
// holding row i's column j, and sum_k q_k x_k = sum_runs d * sum_k u_k xq_k - 128 * sum_k x_k.
// int8 blocks (GGUF's Q8_0: w = q * s per row and run of 32 columns, s fp16; the LM head's format):
// the int8 layout, the scales per block and run as 16 fp16 values [N/16, K/32, 16], and every
// run's product scaled by its own s before the sum; the output is float32 whatever the
// activations' dtype, so that logits keep their order (bf16 logits tie at the top).

// The kernels below are shared by cpu_gemv.cpp (the ops) and cpu_decode.cpp (the decode stack).

#pragma once

#include "cpu_rows.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstring>
#include <type_traits>  // std::integral_constant (for_rows)

#include <cmath>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define CORE_GEMV_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CORE_GEMV_F32 1
#endif
#if defined(CORE_GEMV_BF16) || defined(CORE_GEMV_F32)
#define CORE_GEMV_ANY 1  // block / block8 exist for one activation dtype at least
#endif

namespace core_gemv {

// The dtype of an int4 weight's scales and offsets for activations of dtype x: bf16 (scales and
// zeros) for bf16, fp16 (scales and minimums) for float32 (see the top).
inline c10::ScalarType sz_type(c10::ScalarType x) { return x == c10::kFloat ? c10::kHalf : x; }

// f(rows as a compile-time constant, first row) over M activation rows: R at a time, then 3 at a
// time, then the rest together (each weight block is read once per call of f).
template <int R = 3, typename F>
inline void for_rows(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + R <= M; m += R) f(std::integral_constant<int, R>{}, m);
  if constexpr (R > 3) {
    for (; m + 3 <= M; m += 3) f(std::integral_constant<int, 3>{}, m);
  }
  const int64_t rest = M - m;
  if (rest == 2) f(std::integral_constant<int, 2>{}, m);
  if (rest == 1) f(std::integral_constant<int, 1>{}, m);
}

// Rows of x per int4 block call: the float32 kernel (one half of the block's 16 output rows at a
// time, so AVX2's 16 registers hold 4 rows' sums) takes 4, the bf16 one 6: AVX-512's 32 registers
// hold 6 rows' sums, and each 64-byte chunk of codes is split into its two operands once for 6
// rows instead of 3 (SmolLM2's layer GEMMs at 64 streams ~10 % faster on the Zen 4 EPYC, 2
// threads: 24.6 against 27.3 ms a step; 7 and 8 rows no faster than 6). The int8 kernel, with no
// codes to split, gained nothing from more than 3.
template <typename T>
constexpr int kInt4Rows = std::is_same_v<T, float> ? 4 : 6;

// x as the kernels read it (quantize_rows): int8 codes, their scales, and the sums of what they stand
// for over the weight's groups (int8 weights: G = 1).
struct Act {
  const int8_t* xq;  // [M, K]
  const float* dx;   // [M, K / 32]
  const float* xs;   // [M, G]
};

#ifdef CORE_GEMV_BF16
// x rows [M, K] (bf16 bits, K % 32 == 0) as the kernels read them: for every 32 columns, int8
// codes q = rint(x * 127 / amax) and the scale d = amax / 127 (all zero for an all-zero run); and
// xs [M, G], the sums over G equal groups of columns of the values the codes stand for (d * q, so
// that the kernel's product is exactly that of the quantized row: the weights' zero points then
// do not magnify the rounding of x).
inline void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* dx, float* xs) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const int64_t runs = K / G / 32;  // per group
  for (int64_t r = 0; r < M * K / 32; ++r) {  // rows are contiguous runs of K % 32 == 0 columns
    const int64_t i = 32 * r;
    const __m512 a = core_rows::bf16x16(x + i), b = core_rows::bf16x16(x + i + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i + 16), _mm512_cvtsepi32_epi8(qb));
    const float d = amax / 127.0f;
    dx[r] = d;
    const float sum = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    xs[r / runs] = r % runs ? xs[r / runs] + sum : sum;
  }
}

using core_rows::bf16x16;

// Rows [m0, m0 + M) of x (xq, dx: quantize_rows'; xs: group sums) times int4 row block nb:
// out[m, nb*16 .. nb*16+16).
template <int M>
inline void block(const uint8_t* __restrict qw, const uint16_t* __restrict sz, const int8_t* __restrict xq,
                  const float* __restrict dx, const float* __restrict xs, uint16_t* __restrict out, int64_t K,
                  int64_t G, int64_t N, int64_t nb) {
  constexpr int C = M == 1 ? 2 : 1;  // chains per nibble half and row: enough to hide vpdpbusd latency
  const int64_t gs = K / G;
  const uint8_t* q = qw + nb * K * 8;  // 16 rows x K/2 bytes
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512 k8 = _mm512_set1_ps(8.0f);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 f[M];
    for (int m = 0; m < M; ++m) f[m] = _mm512_setzero_ps();
    for (int64_t a = g * gs; a < (g + 1) * gs; a += 32) {  // 32 columns: four 64-byte chunks
      __m512i is[M][2 * C];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 2 * C; ++j) is[m][j] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(q + (a + 8 * c) * 8);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        const int j = 2 * (c % C);
        for (int m = 0; m < M; ++m) {
          int32_t x0, x1;  // columns a+8c .. +3 and a+8c+4 .. +7 of row m
          std::memcpy(&x0, xq + m * K + a + 8 * c, 4);
          std::memcpy(&x1, xq + m * K + a + 8 * c + 4, 4);
          is[m][j] = _mm512_dpbusd_epi32(is[m][j], lo, _mm512_set1_epi32(x0));
          is[m][j + 1] = _mm512_dpbusd_epi32(is[m][j + 1], hi, _mm512_set1_epi32(x1));
        }
      }
      for (int m = 0; m < M; ++m) {
        __m512i t = is[m][0];
        for (int j = 1; j < 2 * C; ++j) t = _mm512_add_epi32(t, is[m][j]);
        f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(dx[m * (K / 32) + a / 32]), f[m]);
      }
    }
    const uint16_t* sg = sz + (nb * G + g) * 32;
    const __m512 s = bf16x16(sg), c = _mm512_fnmadd_ps(k8, s, bf16x16(sg + 16));  // scales, m = z - 8 s
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_fmadd_ps(f[m], s, acc[m]);
      acc[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(xs[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(acc[m]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + nb * 16), r);
  }
}

// The int32 sums over one run of 32 columns (from column a) of an int8 row block (u = q + 128,
// block8's layout: eight 64-byte chunks) times the int8 codes of M rows of x: t[m], one lane per row.
template <int M>
inline void run_sums_vnni(const uint8_t* __restrict q, const int8_t* __restrict xq, int64_t K, int64_t a, __m512i (&t)[M]) {
  constexpr int C = M == 1 ? 4 : 2;  // dot chains per row
  __m512i is[M][C];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < C; ++j) is[m][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m512i v = _mm512_loadu_si512(q + (a + 4 * c) * 16);
    for (int m = 0; m < M; ++m) {
      int32_t x4;  // columns a+4c .. +3 of row m
      std::memcpy(&x4, xq + m * K + a + 4 * c, 4);
      is[m][c % C] = _mm512_dpbusd_epi32(is[m][c % C], v, _mm512_set1_epi32(x4));
    }
  }
  for (int m = 0; m < M; ++m) {
    t[m] = is[m][0];
    for (int j = 1; j < C; ++j) t[m] = _mm512_add_epi32(t[m], is[m][j]);
  }
}

// Rows [m0, m0 + M) of x (as for block) times int8 row block nb (u = q + 128 per byte, per 16-row
// block and 4 columns 64 bytes, byte 4 i + j holding row i's column j; sc: per-row bf16 scales).
template <int M>
inline void block8(const uint8_t* __restrict qw, const uint16_t* __restrict sc, const int8_t* __restrict xq,
                   const float* __restrict dx, const float* __restrict xs, uint16_t* __restrict out, int64_t K,
                   int64_t N, int64_t nb) {
  const uint8_t* q = qw + nb * K * 16;  // 16 rows x K bytes
  __m512 f[M];
  for (int m = 0; m < M; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t a = 0; a < K; a += 32) {
    __m512i t[M];
    run_sums_vnni<M>(q, xq, K, a, t);
    for (int m = 0; m < M; ++m)
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]), _mm512_set1_ps(dx[m * (K / 32) + a / 32]), f[m]);
  }
  const __m512 s = bf16x16(sc + nb * 16);
  for (int m = 0; m < M; ++m) {  // sum_k q_k x_k = sum_k u_k x_k - 128 sum_k x_k
    const __m512 t = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_set1_ps(xs[m]), f[m]);
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(t, s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + nb * 16), r);
  }
}



// Rows [m0, m0 + M) of x (as for block, with one group per run of 32: xs holds the runs' sums)
// times int8-blocks row block nb (block8's codes; sc: fp16 bits [N/16, K/32, 16]) -> float32 out.
template <int M>
inline void block8g_vnni(const uint8_t* __restrict qw, const uint16_t* __restrict sc, const int8_t* __restrict xq,
                         const float* __restrict dx, const float* __restrict xs, float* __restrict out, int64_t K,
                         int64_t N, int64_t nb) {
  const int64_t R = K / 32;
  const uint8_t* q = qw + nb * K * 16;
  const uint16_t* s = sc + nb * R * 16;
  __m512 f[M];
  for (int m = 0; m < M; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t r = 0; r < R; ++r) {
    __m512i t[M];
    run_sums_vnni<M>(q, xq, K, 32 * r, t);
    const __m512 sr = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + r * 16)));
    for (int m = 0; m < M; ++m) {  // the run's sum_k q_k x_k = d * sum_k u_k xq_k - 128 * (d * sum_k xq_k)
      const __m512 y = _mm512_fmsub_ps(_mm512_cvtepi32_ps(t[m]), _mm512_set1_ps(dx[m * R + r]),
                                       _mm512_set1_ps(128.0f * xs[m * R + r]));
      f[m] = _mm512_fmadd_ps(y, sr, f[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * N + nb * 16, f[m]);
}

#endif  // CORE_GEMV_BF16

#ifdef CORE_GEMV_F32
// ---- float32 activations on AVX2 (every x86-64 CPU since 2013; the dtype --dtype auto picks where
// the CPU has no native bf16): the same layouts and the same int8 quantization of x, with
// vpmaddubsw (4 unsigned codes times 4 signed ones as two 16-bit sums per lane) and vpmaddwd to
// widen; 16 output rows in two registers of 8 lanes; fp16 scales and minimums (int4), fp32 ones
// (int8), fp32 output.

// quantize_rows for fp32 x: the same codes, scales and sums for the same values.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* dx, float* xs) {
  const int64_t runs = K / G / 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < M * K / 32; ++r) {
    const float* p = x + 32 * r;
    __m256 m = _mm256_and_ps(_mm256_loadu_ps(p), absmask);
    for (int j = 8; j < 32; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(p + j), absmask));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(p[j] * inv));  // to nearest even, as torch.round
      xq[32 * r + j] = static_cast<int8_t>(q);
      sum += q;
    }
    dx[r] = d;
    const float s = d * static_cast<float>(sum);
    xs[r / runs] = r % runs ? xs[r / runs] + s : s;
  }
}

// Keeps v in a register at this point of the loop: the compiler may regroup integer sums at will,
// and for the int4 kernel's unrolled runs it computed every product first and spilled them.
inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// The eight 32-bit lanes of v summed in pairs of 16-bit lanes (vpmaddwd by ones).
inline __m256i widen16(__m256i v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }

// The float32 kernels ask for the weight bytes this far ahead of their loads (T0 hint): each GEMM of
// a SmolLM2 decode step is only 0.2-1.3 MB, which the hardware prefetchers pick up late at every
// start; batch-1 decode steps ~5 % shorter on the 2-vCPU EPYC (Zen 3) in interleaved runs (512
// bytes: no gain; the NTA hint: less).
constexpr int kPrefetchBytes = 1024;

// block for float32: rows [m0, m0 + M) of x (quantize_rows) times int4 row block nb (the same
// layout; sz fp16 bits). The block's 16 output rows are two halves of 8 lanes: one or two rows of x take
// both halves in one pass (each 64-byte chunk read once, in order), more rows one half per pass, so
// that their runs' 16-bit sums, groups' fp32 sums and outputs stay in AVX2's 16 registers (4 rows:
// measured ~10 % faster at 64 rows, where both halves at once spilled; at 1 row ~20 % slower).
template <int M>
inline void block(const uint8_t* __restrict qw, const uint16_t* __restrict sz, const int8_t* __restrict xq,
                  const float* __restrict dx, const float* __restrict xs, float* __restrict out, int64_t K,
                  int64_t G, int64_t N, int64_t nb) {
  constexpr int HP = M <= 2 ? 2 : 1;  // halves per pass
  const int64_t gs = K / G;
  const uint8_t* q = qw + nb * K * 8;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int h0 = 0; h0 < 2; h0 += HP) {
    __m256 acc[M][HP];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < HP; ++h) acc[m][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 f[M][HP];
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < HP; ++h) f[m][h] = _mm256_setzero_ps();
      for (int64_t a = g * gs; a < (g + 1) * gs; a += 32) {
        // 16-bit sums of at most 8 products pairs of 15 * 127 per run and lane: they fit (30,480)
        __m256i s16[M][HP];
        for (int m = 0; m < M; ++m)
          for (int h = 0; h < HP; ++h) s16[m][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          for (int h = 0; h < HP; ++h) {
            const uint8_t* src = q + (a + 8 * c) * 8 + 32 * (h0 + h);
            if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) {
              int32_t x0, x1;
              std::memcpy(&x0, xq + m * K + a + 8 * c, 4);
              std::memcpy(&x1, xq + m * K + a + 8 * c + 4, 4);
              s16[m][h] = _mm256_add_epi16(s16[m][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                                                      _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1))));
              pin(s16[m][h]);
            }
          }
        }
        for (int m = 0; m < M; ++m) {
          const __m256 d = _mm256_set1_ps(dx[m * (K / 32) + a / 32]);
          for (int h = 0; h < HP; ++h) f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen16(s16[m][h])), d, f[m][h]);
        }
      }
      for (int h = 0; h < HP; ++h) {
        const uint16_t* sg = sz + (nb * G + g) * 32 + 8 * (h0 + h);
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg)));  // scales
        const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + 16)));  // minimums
        for (int m = 0; m < M; ++m) {
          acc[m][h] = _mm256_fmadd_ps(f[m][h], s, acc[m][h]);
          acc[m][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(xs[m * G + g]), acc[m][h]);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < HP; ++h) _mm256_storeu_ps(out + m * N + nb * 16 + 8 * (h0 + h), acc[m][h]);
  }
}

// The int32 sums over one run of 32 columns (from column a) of an int8 row block (block8's layout)
// times M rows of x's codes, per half of the block's 16 output rows: s32[m][h]. The codes go back
// to signed (u ^ 0x80) and the sign of x moves onto them, so vpmaddubsw multiplies |x| by
// q * sign(x): pairs of at most 127 * 127, no saturation.
template <int M>
inline void run_sums_avx2(const uint8_t* __restrict q, const int8_t* __restrict xq, int64_t K, int64_t a,
                          __m256i (&s32)[M][2]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < M; ++m) s32[m][0] = s32[m][1] = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    __m256i ax[M], xv[M];
    for (int m = 0; m < M; ++m) {
      int32_t x4;
      std::memcpy(&x4, xq + m * K + a + 4 * c, 4);
      xv[m] = _mm256_set1_epi32(x4);
      ax[m] = _mm256_sign_epi8(xv[m], xv[m]);
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* src = q + (a + 4 * c) * 16 + 32 * h;
      if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchBytes), _MM_HINT_T0);
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), flip);
      for (int m = 0; m < M; ++m) {
        s32[m][h] = _mm256_add_epi32(s32[m][h], widen16(_mm256_maddubs_epi16(ax[m], _mm256_sign_epi8(w, xv[m]))));
        pin(s32[m][h]);
      }
    }
  }
}

// block8 for float32: rows of x times int8 row block nb (the same layout, u = q + 128; sc fp32
// per-row scales), through run_sums_avx2: no correction by the sums of x (xs, which the bf16
// kernel needs for its + 128) is left to make.
template <int M>
inline void block8(const uint8_t* __restrict qw, const float* __restrict sc, const int8_t* __restrict xq,
                   const float* __restrict dx, const float* __restrict /*xs*/, float* __restrict out, int64_t K,
                   int64_t N, int64_t nb) {
  const uint8_t* q = qw + nb * K * 16;
  __m256 f[M][2];
  for (int m = 0; m < M; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t a = 0; a < K; a += 32) {
    __m256i s32[M][2];
    run_sums_avx2<M>(q, xq, K, a, s32);
    for (int m = 0; m < M; ++m) {
      const __m256 d = _mm256_set1_ps(dx[m * (K / 32) + a / 32]);
      for (int h = 0; h < 2; ++h) f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[m][h]), d, f[m][h]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(out + m * N + nb * 16 + 8 * h, _mm256_mul_ps(f[m][h], _mm256_loadu_ps(sc + nb * 16 + 8 * h)));
}

// block8g for float32 activations (block8's sign trick, per run scaled by its fp16 s) -> float32 out.
template <int M>
inline void block8g_avx2(const uint8_t* __restrict qw, const uint16_t* __restrict sc, const int8_t* __restrict xq,
                         const float* __restrict dx, const float* __restrict /*xs*/, float* __restrict out, int64_t K,
                         int64_t N, int64_t nb) {
  const int64_t R = K / 32;
  const uint8_t* q = qw + nb * K * 16;
  const uint16_t* s = sc + nb * R * 16;
  __m256 f[M][2];
  for (int m = 0; m < M; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t r = 0; r < R; ++r) {
    __m256i s32[M][2];
    run_sums_avx2<M>(q, xq, K, 32 * r, s32);
    for (int h = 0; h < 2; ++h) {
      const __m256 sr = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + r * 16 + 8 * h)));
      for (int m = 0; m < M; ++m) {
        const __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(s32[m][h]), _mm256_set1_ps(dx[m * R + r]));
        f[m][h] = _mm256_fmadd_ps(y, sr, f[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * N + nb * 16 + 8 * h, f[m][h]);
}
#endif


#ifdef CORE_GEMV_ANY
// One packed weight [N, K]: kind 0 int4 (q codes, s scales then offsets of G groups per row, as
// 16-bit bits: bf16 zeros or fp16 minimums, see the top), 1 int8 (s per-row scales, G = 1, in the
// activations' element type: bf16 bits or float), 3 int8 blocks (s fp16 bits per run, G = K / 32;
// float32 output: weight_block_f32); bias (N values, nullptr for none) in the activations' type.
struct Weight {
  int64_t kind, N, K, G;
  const uint8_t* q;
  const void* s;
  const void* bias = nullptr;
};

// Block nb of w (its 16 output columns) times the M rows of a into out [M, w.N], plus the bias of
// those columns (rounded as torch's add rounds). T: uint16_t (bf16 bits) or float, the element
// type the kernels read and write. The stack's form (kernels/cpu_decode.cpp); the ops in
// cpu_gemv.cpp call block / block8 directly, which measured a few per cent faster for them.
template <typename T>
inline void weight_block(const Weight& w, const Act& a, T* out, int64_t M, int64_t nb) {
  if (w.kind == 0) {
    for_rows<kInt4Rows<T>>(M, [&](auto rows, int64_t m) {
      block<rows.value>(w.q, static_cast<const uint16_t*>(w.s), a.xq + m * w.K, a.dx + m * (w.K / 32), a.xs + m * w.G,
                        out + m * w.N, w.K, w.G, w.N, nb);
    });
  } else {
    for_rows(M, [&](auto rows, int64_t m) {
      block8<rows.value>(w.q, static_cast<const T*>(w.s), a.xq + m * w.K, a.dx + m * (w.K / 32), a.xs + m, out + m * w.N, w.K, w.N, nb);
    });
  }
  if (w.bias) {
    using E = std::conditional_t<std::is_same_v<T, float>, float, c10::BFloat16>;
    const E* b = static_cast<const E*>(w.bias) + nb * 16;
    for (int64_t m = 0; m < M; ++m) {
      E* o = reinterpret_cast<E*>(out + m * w.N + nb * 16);
      core_rows::add_row<E>(o, b, o, 16);
    }
  }
}

// Block nb of an int8-blocks weight (kind 3, no bias) times the M rows of a into float32 out [M, w.N],
// with the kernel of the activations' dtype T (bf16 bits: VNNI; float: AVX2).
template <typename T>
inline void weight_block_f32(const Weight& w, const Act& a, float* out, int64_t M, int64_t nb) {
  const uint16_t* s = static_cast<const uint16_t*>(w.s);
  for_rows(M, [&](auto rows, int64_t m) {
    const int64_t R = w.K / 32;
    if constexpr (std::is_same_v<T, float>) {
#ifdef CORE_GEMV_F32
      block8g_avx2<rows.value>(w.q, s, a.xq + m * w.K, a.dx + m * R, a.xs + m * R, out + m * w.N, w.K, w.N, nb);
#endif
    } else {
#ifdef CORE_GEMV_BF16
      block8g_vnni<rows.value>(w.q, s, a.xq + m * w.K, a.dx + m * R, a.xs + m * R, out + m * w.N, w.K, w.N, nb);
#endif
    }
  });
}
#endif

}  // namespace core_gemv
