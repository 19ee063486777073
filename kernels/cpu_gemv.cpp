// Packed int4 (group-wise), int8 (per-channel) and int8-blocks (Q8_0) weights times a few activation rows: bf16 on CPUs
// with AVX512-BF16 and AVX512-VNNI, fp32 on CPUs with AVX2 and FMA. The ops around the kernels of
// cpu_gemv.h (its header comment says how they work).

#include "cpu_gemv.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

namespace {

bool supported() {
#ifdef CORE_GEMV_BF16
  return true;
#else
  return false;
#endif
}

bool supported_f32() {
#ifdef CORE_GEMV_F32
  return true;
#else
  return false;
#endif
}

using namespace core_gemv;

// Rows of x per pass over a thread's weight blocks: a prefill chunk's int8 codes (2,048 rows x
// 576 columns: 1.2 MB) fall out of L2 between two blocks, 64 rows (37 KB) stay. A 2,048-row
// SmolLM2 layer's GEMMs ~10 % faster on the 2-vCPU EPYC (Zen 3); decode batches are one pass.
constexpr int64_t kTileRows = 64;

// Every 16-row block of the weight (split over threads) times the M rows of x, R at a time
// (for_rows), kTileRows rows per pass: f(rows as a compile-time constant, first row, block).
template <int R = 3, typename F>
void for_blocks(int64_t NB, int64_t M, F&& f) {
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int64_t mt = std::min(kTileRows, M - m0);
      for (int64_t nb = b0; nb < b1; ++nb) for_rows<R>(mt, [&](auto rows, int64_t m) { f(rows, m0 + m, nb); });
    }
  });
}

// f(T{}) for x's dtype, T the element type the kernels read and write: bf16 bits or float.
template <typename F>
void for_dtype(const at::Tensor& x, F&& f) {
#ifdef CORE_GEMV_BF16
  if (x.scalar_type() == at::kBFloat16) f(uint16_t{});
#endif
#ifdef CORE_GEMV_F32
  if (x.scalar_type() == at::kFloat) f(float{});
#endif
}

template <typename T>
const T* data(const at::Tensor& t) {
  return static_cast<const T*>(t.const_data_ptr());
}

// x [M, K] (bf16 or fp32) as the kernels read it, for weights of G groups (int8: 1): int8 codes,
// their scales and group sums (the tensors own the memory act points into).
struct Prepared {
  at::Tensor xq, f;
  Act act{};
  Prepared(const at::Tensor& x, int64_t G)
      : xq(at::empty(x.sizes(), x.options().dtype(at::kChar))),
        f(at::empty({x.size(0) * (x.size(1) / 32 + G)}, x.options().dtype(at::kFloat))) {
    float *dx = f.data_ptr<float>(), *xs = dx + x.size(0) * (x.size(1) / 32);
    int8_t* q = xq.data_ptr<int8_t>();
    for_dtype(x, [&](auto t) { quantize_rows(data<decltype(t)>(x), x.size(0), x.size(1), G, q, dx, xs); });
    act = {q, dx, xs};
  }
};

// x's dtype has a kernel in this build: bf16 (AVX512-BF16 and VNNI) or fp32 (AVX2 and FMA).
void check_kernel(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              op, ": x [M, K] contiguous bf16 or float32");
  TORCH_CHECK(x.scalar_type() == at::kFloat || supported(), op, ": this build has no AVX512-BF16 and AVX512-VNNI");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || supported_f32(), op, ": this build has no AVX2 and FMA");
}

// x [M, K] bf16 or fp32; qw [N/16, K/8, 16, 4] uint8; sz [N/16, G, 2, 16] (scales, then offsets:
// cpu_gemv.h) of sz_type(x's dtype) -> [M, N] of x's dtype.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& sz) {
  check_kernel("int4_mm", x);
  TORCH_CHECK(qw.dim() == 4 && qw.scalar_type() == at::kByte && qw.size(2) == 16 && qw.size(3) == 4 && qw.is_contiguous(),
              "int4_mm: qw [N/16, K/8, 16, 4] uint8");
  const int64_t M = x.size(0), K = x.size(1), NB = qw.size(0), N = NB * 16, G = sz.size(1);
  TORCH_CHECK(qw.size(1) * 8 == K, "int4_mm: x has ", K, " columns, the weight ", qw.size(1) * 8);
  TORCH_CHECK(sz.dim() == 4 && sz.size(0) == NB && sz.size(2) == 2 && sz.size(3) == 16 && G > 0 && K % G == 0 &&
                  (K / G) % 32 == 0 && sz.scalar_type() == sz_type(x.scalar_type()) && sz.is_contiguous(),
              "int4_mm: sz [N/16, G, 2, 16] of ", sz_type(x.scalar_type()), " for ", x.scalar_type(),
              " x (packed for x's dtype), groups of a multiple of 32 columns; got ", sz.scalar_type(), " ", sz.sizes());
  auto out = at::empty({M, N}, x.options());
#ifdef CORE_GEMV_ANY
  const Prepared p(x, G);
  const uint8_t* q = qw.const_data_ptr<uint8_t>();
  for_dtype(x, [&](auto t) {
    using T = decltype(t);
    const uint16_t* szp = data<uint16_t>(sz);
    T* op = static_cast<T*>(out.data_ptr());
    for_blocks<kInt4Rows<T>>(NB, M, [&](auto rows, int64_t m, int64_t nb) {
      block<rows.value>(q, szp, p.act.xq + m * K, p.act.dx + m * (K / 32), p.act.xs + m * G, op + m * N, K, G, N, nb);
    });
  });
#endif
  return out;
}

// x [M, K] bf16 or fp32; qw [N/16, K/4, 16, 4] uint8 (q + 128); scale [N] of x's dtype -> [M, N].
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale) {
  check_kernel("int8_mm", x);
  TORCH_CHECK(qw.dim() == 4 && qw.scalar_type() == at::kByte && qw.size(2) == 16 && qw.size(3) == 4 && qw.is_contiguous(),
              "int8_mm: qw [N/16, K/4, 16, 4] uint8");
  const int64_t M = x.size(0), K = x.size(1), NB = qw.size(0), N = NB * 16;
  TORCH_CHECK(qw.size(1) * 4 == K && K % 32 == 0, "int8_mm: x has ", K, " columns, the weight ", qw.size(1) * 4,
              " (a multiple of 32)");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == x.scalar_type() && scale.is_contiguous(),
              "int8_mm: scale [N] of x's dtype");
  auto out = at::empty({M, N}, x.options());
#ifdef CORE_GEMV_ANY
  const Prepared p(x, 1);
  const uint8_t* q = qw.const_data_ptr<uint8_t>();
  for_dtype(x, [&](auto t) {
    using T = decltype(t);
    const T* sc = data<T>(scale);
    T* op = static_cast<T*>(out.data_ptr());
    for_blocks(NB, M, [&](auto rows, int64_t m, int64_t nb) {
      block8<rows.value>(q, sc, p.act.xq + m * K, p.act.dx + m * (K / 32), p.act.xs + m, op + m * N, K, N, nb);
    });
  });
#endif
  return out;
}

// x [M, K] bf16 or fp32; qw as int8_mm's; scale [N/16, K/32, 16] fp16 (one per row and run of 32
// columns: GGUF's Q8_0) -> float32 [M, N] (the LM head's format, cpu_gemv.h).
at::Tensor int8_blocks_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale) {
  check_kernel("int8_blocks_mm", x);
  TORCH_CHECK(qw.dim() == 4 && qw.scalar_type() == at::kByte && qw.size(2) == 16 && qw.size(3) == 4 && qw.is_contiguous(),
              "int8_blocks_mm: qw [N/16, K/4, 16, 4] uint8");
  const int64_t M = x.size(0), K = x.size(1), NB = qw.size(0), N = NB * 16;
  TORCH_CHECK(qw.size(1) * 4 == K && K % 32 == 0, "int8_blocks_mm: x has ", K, " columns, the weight ", qw.size(1) * 4,
              " (a multiple of 32)");
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == NB && scale.size(1) == K / 32 && scale.size(2) == 16 &&
                  scale.scalar_type() == at::kHalf && scale.is_contiguous(),
              "int8_blocks_mm: scale [N/16, K/32, 16] fp16");
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
#ifdef CORE_GEMV_ANY
  const Prepared p(x, K / 32);
  const Weight w{3, N, K, K / 32, qw.const_data_ptr<uint8_t>(), scale.const_data_ptr()};
  float* op = out.data_ptr<float>();
  for_dtype(x, [&](auto t) {
    at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t mt = std::min(kTileRows, M - m0);
        const Act a{p.act.xq + m0 * K, p.act.dx + m0 * (K / 32), p.act.xs + m0 * (K / 32)};
        for (int64_t nb = b0; nb < b1; ++nb) weight_block_f32<decltype(t)>(w, a, op + m0 * N, mt, nb);
      }
    });
  });
#endif
  return out;
}

// Two weights times the same x (a gate and an up projection) in one pass over threads: one parallel
// region and one quantization of x instead of two (a fork and a join cost ~4 us at decode sizes).
// Each output block is computed as int4_mm / int8_mm computes it, so the results are the same.
// [M, NA * 16] and [M, NB * 16] outputs of element type T; f(rows, m, nb, out of that block's
// weight, its block index).
template <typename T, int R = 3, typename F>
std::tuple<at::Tensor, at::Tensor> pair_blocks(const at::Tensor& x, int64_t NA, int64_t NB, F&& f) {
  auto oa = at::empty({x.size(0), NA * 16}, x.options()), ob = at::empty({x.size(0), NB * 16}, x.options());
  T *opa = static_cast<T*>(oa.data_ptr()), *opb = static_cast<T*>(ob.data_ptr());
  for_blocks<R>(NA + NB, x.size(0), [&](auto rows, int64_t m, int64_t nb) {
    if (nb < NA)
      f(rows, m, 0, opa + m * NA * 16, NA * 16, nb);
    else
      f(rows, m, 1, opb + m * NB * 16, NB * 16, nb - NA);
  });
  return {oa, ob};
}

std::tuple<at::Tensor, at::Tensor> int4_mm_pair(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa,
                                                const at::Tensor& qb, const at::Tensor& sb) {
  check_kernel("int4_mm_pair", x);
  TORCH_CHECK(qa.is_contiguous() && qb.is_contiguous() && sa.is_contiguous() && sb.is_contiguous() && qa.dim() == 4 &&
                  qb.dim() == 4 && qa.size(1) == qb.size(1) && sa.size(1) == sb.size(1) && qa.size(1) * 8 == x.size(1) &&
                  x.size(1) % sa.size(1) == 0 && (x.size(1) / sa.size(1)) % 32 == 0 &&
                  sa.scalar_type() == sz_type(x.scalar_type()) && sb.scalar_type() == sz_type(x.scalar_type()),
              "int4_mm_pair: as int4_mm for each weight, both of one K and group size");
  std::tuple<at::Tensor, at::Tensor> out;
#ifdef CORE_GEMV_ANY
  const int64_t K = x.size(1), G = sa.size(1);
  const Prepared p(x, G);
  const uint8_t* q[2] = {qa.const_data_ptr<uint8_t>(), qb.const_data_ptr<uint8_t>()};
  for_dtype(x, [&](auto t) {
    using T = decltype(t);
    const uint16_t* z[2] = {data<uint16_t>(sa), data<uint16_t>(sb)};
    out = pair_blocks<T, kInt4Rows<T>>(x, qa.size(0), qb.size(0), [&](auto rows, int64_t m, int w, T* o, int64_t N, int64_t nb) {
      block<rows.value>(q[w], z[w], p.act.xq + m * K, p.act.dx + m * (K / 32), p.act.xs + m * G, o, K, G, N, nb);
    });
  });
#endif
  return out;
}

std::tuple<at::Tensor, at::Tensor> int8_mm_pair(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa,
                                                const at::Tensor& qb, const at::Tensor& sb) {
  check_kernel("int8_mm_pair", x);
  TORCH_CHECK(qa.is_contiguous() && qb.is_contiguous() && sa.is_contiguous() && sb.is_contiguous() && qa.dim() == 4 &&
                  qb.dim() == 4 && qa.size(1) * 4 == x.size(1) && qb.size(1) * 4 == x.size(1) && x.size(1) % 32 == 0 &&
                  sa.size(0) == qa.size(0) * 16 && sb.size(0) == qb.size(0) * 16 &&
                  sa.scalar_type() == x.scalar_type() && sb.scalar_type() == x.scalar_type(),
              "int8_mm_pair: as int8_mm for each weight");
  std::tuple<at::Tensor, at::Tensor> out;
#ifdef CORE_GEMV_ANY
  const int64_t K = x.size(1);
  const Prepared p(x, 1);
  const uint8_t* q[2] = {qa.const_data_ptr<uint8_t>(), qb.const_data_ptr<uint8_t>()};
  for_dtype(x, [&](auto t) {
    using T = decltype(t);
    const T* c[2] = {data<T>(sa), data<T>(sb)};
    out = pair_blocks<T>(x, qa.size(0), qb.size(0), [&](auto rows, int64_t m, int w, T* o, int64_t N, int64_t nb) {
      block8<rows.value>(q[w], c[w], p.act.xq + m * K, p.act.dx + m * (K / 32), p.act.xs + m, o, K, N, nb);
    });
  });
#endif
  return out;
}

bool gemv_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY(core_cpu_gemv, m) {
  m.def("int4_mm(Tensor x, Tensor qw, Tensor sz) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor qw, Tensor scale) -> Tensor");
  m.def("int8_blocks_mm(Tensor x, Tensor qw, Tensor scale) -> Tensor");
  m.def("int4_mm_pair(Tensor x, Tensor qa, Tensor sa, Tensor qb, Tensor sb) -> (Tensor, Tensor)");
  m.def("int8_mm_pair(Tensor x, Tensor qa, Tensor sa, Tensor qb, Tensor sb) -> (Tensor, Tensor)");
  m.def("supported() -> bool", &gemv_supported);
  m.def("supported_f32() -> bool", &supported_f32);
}

TORCH_LIBRARY_IMPL(core_cpu_gemv, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_blocks_mm", &int8_blocks_mm);
  m.impl("int4_mm_pair", &int4_mm_pair);
  m.impl("int8_mm_pair", &int8_mm_pair);
}
