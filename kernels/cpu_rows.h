// Row loops shared by the CPU ops (cpu_ops.cpp) and the one-op decoder (cpu_decode.cpp): RMS norm,
// residual add and rotary embedding of one row (and a row's argmax), each rounding intermediates to the activation
// dtype where the torch code in core/layers.py rounds them, so that every caller gives the same bits.
// bf16 has raw-bit specialisations that vectorise.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace core_rows {

template <typename T>
inline float rnd(float x) {  // store in T and read back: the rounding torch applies to a T intermediate
  return static_cast<float>(static_cast<T>(x));
}

// bf16 as raw bits, so that the loops below vectorise (c10's conversions branch on NaN):
// widening is a shift, narrowing rounds to nearest even as c10 does (NaN stays a quiet NaN).
inline float bf16_f(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t f_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t r = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : r;
}
inline float rnd_bf16(float x) { return bf16_f(f_bf16(x)); }

#if defined(__AVX512F__)
// 16 bf16 (raw bits) -> 16 fp32, exactly.
inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// One row of RMS norm: w * round(x * r), or Gemma's (x * r) * (offset + w) rounded once.
template <typename T>
inline void norm_row(const T* xi, const T* w, T* oi, int64_t n, float eps, float offset) {
  float ss = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    float v = static_cast<float>(xi[j]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (offset != 0.f) {
    for (int64_t j = 0; j < n; ++j) oi[j] = static_cast<T>(static_cast<float>(xi[j]) * r * (offset + static_cast<float>(w[j])));
  } else {
    for (int64_t j = 0; j < n; ++j) oi[j] = static_cast<T>(static_cast<float>(w[j]) * rnd<T>(static_cast<float>(xi[j]) * r));
  }
}

template <>
inline void norm_row<c10::BFloat16>(const c10::BFloat16* x16, const c10::BFloat16* w16, c10::BFloat16* o16, int64_t n,
                             float eps, float offset) {
  const uint16_t* xi = reinterpret_cast<const uint16_t*>(x16);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w16);
  uint16_t* oi = reinterpret_cast<uint16_t*>(o16);
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += bf16_f(xi[j]) * bf16_f(xi[j]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (offset != 0.f) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) oi[j] = f_bf16(bf16_f(xi[j]) * r * (offset + bf16_f(w[j])));
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) oi[j] = f_bf16(bf16_f(w[j]) * rnd_bf16(bf16_f(xi[j]) * r));
  }
}

// s = a + b for one row, rounded to T as torch's add rounds.
template <typename T>
inline void add_row(const T* a, const T* b, T* s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) s[j] = static_cast<T>(static_cast<float>(a[j]) + static_cast<float>(b[j]));
}

template <>
inline void add_row<c10::BFloat16>(const c10::BFloat16* a16, const c10::BFloat16* b16, c10::BFloat16* s16, int64_t n) {
  const uint16_t *a = reinterpret_cast<const uint16_t*>(a16), *b = reinterpret_cast<const uint16_t*>(b16);
  uint16_t* s = reinterpret_cast<uint16_t*>(s16);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] = f_bf16(bf16_f(a[j]) + bf16_f(b[j]));
}

template <typename T>
inline void rotate_head(const T* src, T* dst, const float* cs, const float* sn, int64_t half, int64_t d) {
  for (int64_t i = 0; i < half; ++i) {  // x * cos + rotate_half(x) * sin, each product rounded to T
    const float c = rnd<T>(cs[i]), s = rnd<T>(sn[i]);
    const float x1 = static_cast<float>(src[i]), x2 = static_cast<float>(src[half + i]);
    dst[i] = static_cast<T>(rnd<T>(x1 * c) + rnd<T>(-x2 * s));
    dst[half + i] = static_cast<T>(rnd<T>(x2 * c) + rnd<T>(x1 * s));
  }
  for (int64_t i = 2 * half; i < d; ++i) dst[i] = src[i];  // partial rotary: the rest passes through
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// f_bf16 and rnd_bf16 on 16 lanes, bit for bit (the same integer rounding, NaN to the quiet NaN).
inline __m256i f_bf16x16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}
inline __m512 widen_bf16x16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }
inline __m512 rnd_bf16x16(__m512 f) { return widen_bf16x16(f_bf16x16(f)); }
#endif

template <>
inline void rotate_head<c10::BFloat16>(const c10::BFloat16* src16, c10::BFloat16* dst16, const float* cs, const float* sn,
                                int64_t half, int64_t d) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(src16);
  uint16_t* dst = reinterpret_cast<uint16_t*>(dst16);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // whole runs of 16 pairs in the loop below, vectorised at 512 bits; the rest (all of a head dim of 16:
  // half = 8) masked, not in the loop's scalar remainder (~4 ns a value where the vectors take ~0.5)
  const int64_t whole = half & ~int64_t{15};
#else
  const int64_t whole = half;
#endif
#pragma omp simd
  for (int64_t i = 0; i < whole; ++i) {
    const float c = rnd_bf16(cs[i]), s = rnd_bf16(sn[i]);
    const float x1 = bf16_f(src[i]), x2 = bf16_f(src[half + i]);
    dst[i] = f_bf16(rnd_bf16(x1 * c) + rnd_bf16(-x2 * s));
    dst[half + i] = f_bf16(rnd_bf16(x2 * c) + rnd_bf16(x1 * s));
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (whole < half) {  // the same arithmetic on the last half - whole (< 16) pairs
    const int64_t i = whole;
    const __mmask16 m = static_cast<__mmask16>((1u << (half - whole)) - 1);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    const __m512 c = rnd_bf16x16(_mm512_maskz_loadu_ps(m, cs + i)), s = rnd_bf16x16(_mm512_maskz_loadu_ps(m, sn + i));
    const __m512 x1 = widen_bf16x16(_mm256_maskz_loadu_epi16(m, src + i));
    const __m512 x2 = widen_bf16x16(_mm256_maskz_loadu_epi16(m, src + half + i));
    const __m512 nx2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign));  // -x2, exactly
    _mm256_mask_storeu_epi16(dst + i, m, f_bf16x16(_mm512_add_ps(rnd_bf16x16(_mm512_mul_ps(x1, c)), rnd_bf16x16(_mm512_mul_ps(nx2, s)))));
    _mm256_mask_storeu_epi16(dst + half + i, m,
                             f_bf16x16(_mm512_add_ps(rnd_bf16x16(_mm512_mul_ps(x2, c)), rnd_bf16x16(_mm512_mul_ps(x1, s)))));
  }
#endif
  for (int64_t i = 2 * half; i < d; ++i) dst[i] = src[i];
}

// Row-wise argmax of float32 or bf16 logits, first index of the maximum (a NaN counts as the
// maximum), as torch.argmax returns it (bf16 rows as torch.argmax of their exact float32 values:
// a greedy step needs no float32 copy of its logits); torch's own loop does not vectorise (0.9 ms
// for 64 x 49152). Blocks of 256: their maxima (one vectorised pass), the first block holding the
// row's maximum, then a scan of that block alone.
inline float logit_value(const float* r, int64_t j) { return r[j]; }
inline float logit_value(const uint16_t* r, int64_t j) { return bf16_f(r[j]); }
#if defined(__AVX512F__)
inline __m512 logits16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 logits16(const uint16_t* p) { return bf16x16(p); }
#elif defined(__AVX2__)
inline __m256 logits8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 logits8(const uint16_t* p) {  // bf16 bits widened: the float with the same upper half
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

constexpr int64_t kArgmaxBlock = 256;  // argmax's block

template <typename E>
inline int64_t argmax_row(const E* r, int64_t n, std::vector<float>& bmax) {
  const int64_t nb = (n + kArgmaxBlock - 1) / kArgmaxBlock;
  bool nan = false;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kArgmaxBlock, hi = std::min(n, lo + kArgmaxBlock);
    float m = -std::numeric_limits<float>::infinity();
    int64_t j = lo;
#if defined(__AVX512F__)
    if (hi - lo == kArgmaxBlock) {
      __m512 v0 = _mm512_set1_ps(m), v1 = v0;
      __mmask16 un = 0;
      for (; j < hi; j += 32) {
        const __m512 a = logits16(r + j), c = logits16(r + j + 16);
        un |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q);
        v0 = _mm512_max_ps(v0, a);
        v1 = _mm512_max_ps(v1, c);
      }
      m = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
      nan = nan || un;
    }
#elif defined(__AVX2__)
    if (hi - lo == kArgmaxBlock) {  // the same on 8 lanes (a scalar loop here took ~100 us for one 49152-wide row)
      __m256 v0 = _mm256_set1_ps(m), v1 = v0, un = _mm256_setzero_ps();
      for (; j < hi; j += 16) {
        const __m256 a = logits8(r + j), c = logits8(r + j + 8);
        un = _mm256_or_ps(un, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(c, c, _CMP_UNORD_Q)));
        v0 = _mm256_max_ps(v0, a);
        v1 = _mm256_max_ps(v1, c);
      }
      alignas(32) float t[8];
      _mm256_store_ps(t, _mm256_max_ps(v0, v1));
      m = *std::max_element(t, t + 8);
      nan = nan || _mm256_movemask_ps(un);
    }
#endif
    for (; j < hi; ++j) {
      const float x = logit_value(r, j);
      m = std::max(m, x);
      nan = nan || x != x;
    }
    bmax[b] = m;
  }
  int64_t best = 0;
  if (nan) {
    while (logit_value(r, best) == logit_value(r, best)) ++best;
  } else {
    const float m = *std::max_element(bmax.begin(), bmax.begin() + nb);
    best = (std::find(bmax.begin(), bmax.begin() + nb, m) - bmax.begin()) * kArgmaxBlock;
    while (logit_value(r, best) != m) ++best;
  }
  return best;
}

// e^x for x <= 0 (relative error ~2e-7), written so that the compiler vectorises it.
inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float y = x - n * 0.693145752f - n * 1.42860677e-06f;    // Cody-Waite: |y| <= ln2 / 2
  float p = 1.0f / 720;
  p = p * y + 1.0f / 120;
  p = p * y + 1.0f / 24;
  p = p * y + 1.0f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &e, sizeof s);
  return p * s;
}

// e^x for x <= 0, the polynomial of exp_neg, on 8 lanes (AVX2) and 16 (AVX-512).
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 vexp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 y = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  y = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-06f), y);
  __m256 r = _mm256_set1_ps(1.0f / 720);
  r = _mm256_fmadd_ps(r, y, _mm256_set1_ps(1.0f / 120));
  r = _mm256_fmadd_ps(r, y, _mm256_set1_ps(1.0f / 24));
  r = _mm256_fmadd_ps(r, y, _mm256_set1_ps(1.0f / 6));
  r = _mm256_fmadd_ps(r, y, _mm256_set1_ps(0.5f));
  r = _mm256_fmadd_ps(r, y, _mm256_set1_ps(1.0f));
  r = _mm256_fmadd_ps(r, y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(r, _mm256_castsi256_ps(e));
}
#endif
#if defined(__AVX512F__)
inline __m512 vexp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  y = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), y);
  __m512 r = _mm512_set1_ps(1.0f / 720);
  r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.0f / 120));
  r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.0f / 24));
  r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.0f / 6));
  r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(0.5f));
  r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.0f));
  r = _mm512_fmadd_ps(r, y, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(r, _mm512_castsi512_ps(e));
}
#endif

}  // namespace core_rows
