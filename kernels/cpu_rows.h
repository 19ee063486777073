// Row loops shared by the CPU ops (cpu_ops.cpp) and the one-op decoder (cpu_decode.cpp): RMS norm,
// residual add and rotary embedding of one row, each rounding intermediates to the activation
// dtype where the torch code in core/layers.py rounds them, so that every caller gives the same bits.
// bf16 has raw-bit specialisations that vectorise.

#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
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

template <>
inline void rotate_head<c10::BFloat16>(const c10::BFloat16* src16, c10::BFloat16* dst16, const float* cs, const float* sn,
                                int64_t half, int64_t d) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(src16);
  uint16_t* dst = reinterpret_cast<uint16_t*>(dst16);
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float c = rnd_bf16(cs[i]), s = rnd_bf16(sn[i]);
    const float x1 = bf16_f(src[i]), x2 = bf16_f(src[half + i]);
    dst[i] = f_bf16(rnd_bf16(x1 * c) + rnd_bf16(-x2 * s));
    dst[half + i] = f_bf16(rnd_bf16(x2 * c) + rnd_bf16(x1 * s));
  }
  for (int64_t i = 2 * half; i < d; ++i) dst[i] = src[i];
}

}  // namespace core_rows
