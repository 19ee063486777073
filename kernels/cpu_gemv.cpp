// Packed int4 (group-wise) and int8 (per-channel) weights times a few bf16 activation rows, on
// CPUs with AVX512-BF16: the ops around the kernels of cpu_gemv.h (its header comment says how they work).

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

#ifdef CORE_GEMV_BF16
using namespace core_gemv;

// Every 16-row block nb of a weight (split over threads): f(nb).
template <typename F>
void for_blocks(int64_t NB, F&& f) {
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) f(nb);
  });
}

inline const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.const_data_ptr()); }

// out [M, w.N] = x [M, K] w^T, with xs x's group sums for w.G.
at::Tensor mm(const Weight& w, const at::Tensor& x, const at::Tensor& xs) {
  auto out = at::empty({x.size(0), w.N}, x.options());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint16_t* xp = bits(x);
  const float* s = xs.const_data_ptr<float>();
  const int64_t M = x.size(0);
  if (w.kind == 0)  // the kind outside the loop: the int4 and int8 loops each stay one kernel
    for_blocks(w.N / 16, [&](int64_t nb) { weight_block<0>(w, xp, s, o, M, nb); });
  else
    for_blocks(w.N / 16, [&](int64_t nb) { weight_block<1>(w, xp, s, o, M, nb); });
  return out;
}

// Two weights times the same x (a gate and an up projection) in one pass over threads: one parallel
// region and one set of group sums instead of two (a fork and a join cost ~4 us at decode sizes).
// Each output block is computed as mm computes it, so the results are the same.
std::tuple<at::Tensor, at::Tensor> mm_pair(const Weight& a, const Weight& b, const at::Tensor& x, const at::Tensor& xs) {
  auto oa = at::empty({x.size(0), a.N}, x.options()), ob = at::empty({x.size(0), b.N}, x.options());
  uint16_t *pa = reinterpret_cast<uint16_t*>(oa.data_ptr()), *pb = reinterpret_cast<uint16_t*>(ob.data_ptr());
  const uint16_t* xp = bits(x);
  const float* s = xs.const_data_ptr<float>();
  const int64_t M = x.size(0), na = a.N / 16;
  for_blocks(na + b.N / 16, [&](int64_t nb) {
    if (nb < na)
      weight_block(a, xp, s, pa, M, nb);
    else
      weight_block(b, xp, s, pb, M, nb - na);
  });
  return {oa, ob};
}
#endif

// [M, G] fp32: the sums of each row of x [M, K] bf16 over G equal groups of columns.
at::Tensor group_sums(const at::Tensor& x, int64_t G) {
  auto xs = at::empty({x.size(0), G}, x.options().dtype(at::kFloat));
  core_gemv::group_sums(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), x.size(0), x.size(1), G, xs.data_ptr<float>());
  return xs;
}

// x [M, K] bf16; qw [N/16, K/2, 16] uint8; sz [N/16, G, 2, 16] bf16 (scales, then zeros) -> [M, N] bf16.
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& sz) {
  TORCH_CHECK(supported(), "int4_mm: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int4_mm: x [M, K] contiguous bf16");
  TORCH_CHECK(qw.dim() == 3 && qw.scalar_type() == at::kByte && qw.size(2) == 16 && qw.is_contiguous(),
              "int4_mm: qw [N/16, K/2, 16] uint8");
  const int64_t K = x.size(1), NB = qw.size(0), G = sz.size(1);
  TORCH_CHECK(qw.size(1) * 2 == K, "int4_mm: x has ", K, " columns, the weight ", qw.size(1) * 2);
  TORCH_CHECK(sz.dim() == 4 && sz.size(0) == NB && sz.size(2) == 2 && sz.size(3) == 16 && G > 0 && K % G == 0 &&
                  (K / G) % 8 == 0 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous(),
              "int4_mm: sz [N/16, G, 2, 16] bfloat16, groups of a multiple of 8 columns");
#ifdef CORE_GEMV_BF16
  return mm({0, NB * 16, K, G, qw.const_data_ptr<uint8_t>(), bits(sz)}, x, group_sums(x, G));
#else
  return at::empty({x.size(0), NB * 16}, x.options());
#endif
}

// x [M, K] bf16; qw [N/16, K/2, 16, 2] uint8 (q + 128); scale [N] bf16 -> [M, N] bf16.
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale) {
  TORCH_CHECK(supported(), "int8_mm: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "int8_mm: x [M, K] contiguous bf16");
  TORCH_CHECK(qw.dim() == 4 && qw.scalar_type() == at::kByte && qw.size(2) == 16 && qw.size(3) == 2 && qw.is_contiguous(),
              "int8_mm: qw [N/16, K/2, 16, 2] uint8");
  const int64_t K = x.size(1), N = qw.size(0) * 16;
  TORCH_CHECK(qw.size(1) * 2 == K && K % 8 == 0, "int8_mm: x has ", K, " columns, the weight ", qw.size(1) * 2,
              " (a multiple of 8)");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kBFloat16 && scale.is_contiguous(),
              "int8_mm: scale [N] bfloat16");
#ifdef CORE_GEMV_BF16
  return mm({1, N, K, 1, qw.const_data_ptr<uint8_t>(), bits(scale)}, x, group_sums(x, 1));
#else
  return at::empty({x.size(0), N}, x.options());
#endif
}

std::tuple<at::Tensor, at::Tensor> int4_mm_pair(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa,
                                                const at::Tensor& qb, const at::Tensor& sb) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && qa.is_contiguous() &&
                  qb.is_contiguous() && sa.is_contiguous() && sb.is_contiguous() && qa.size(1) == qb.size(1) &&
                  sa.size(1) == sb.size(1) && qa.size(1) * 2 == x.size(1) && x.size(1) % sa.size(1) == 0 &&
                  (x.size(1) / sa.size(1)) % 8 == 0,
              "int4_mm_pair: as int4_mm for each weight, both of one K and group size");
#ifdef CORE_GEMV_BF16
  const int64_t K = x.size(1), G = sa.size(1);
  return mm_pair({0, qa.size(0) * 16, K, G, qa.const_data_ptr<uint8_t>(), bits(sa)},
                 {0, qb.size(0) * 16, K, G, qb.const_data_ptr<uint8_t>(), bits(sb)}, x, group_sums(x, G));
#else
  TORCH_CHECK(false, "int4_mm_pair: this build has no AVX512-BF16");
#endif
}

std::tuple<at::Tensor, at::Tensor> int8_mm_pair(const at::Tensor& x, const at::Tensor& qa, const at::Tensor& sa,
                                                const at::Tensor& qb, const at::Tensor& sb) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && qa.is_contiguous() &&
                  qb.is_contiguous() && sa.is_contiguous() && sb.is_contiguous() && qa.size(1) * 2 == x.size(1) &&
                  qb.size(1) * 2 == x.size(1) && x.size(1) % 8 == 0 && sa.size(0) == qa.size(0) * 16 &&
                  sb.size(0) == qb.size(0) * 16,
              "int8_mm_pair: as int8_mm for each weight");
#ifdef CORE_GEMV_BF16
  const int64_t K = x.size(1);
  return mm_pair({1, qa.size(0) * 16, K, 1, qa.const_data_ptr<uint8_t>(), bits(sa)},
                 {1, qb.size(0) * 16, K, 1, qb.const_data_ptr<uint8_t>(), bits(sb)}, x, group_sums(x, 1));
#else
  TORCH_CHECK(false, "int8_mm_pair: this build has no AVX512-BF16");
#endif
}

bool gemv_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY(core_cpu_gemv, m) {
  m.def("int4_mm(Tensor x, Tensor qw, Tensor sz) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor qw, Tensor scale) -> Tensor");
  m.def("int4_mm_pair(Tensor x, Tensor qa, Tensor sa, Tensor qb, Tensor sb) -> (Tensor, Tensor)");
  m.def("int8_mm_pair(Tensor x, Tensor qa, Tensor sa, Tensor qb, Tensor sb) -> (Tensor, Tensor)");
  m.def("supported() -> bool", &gemv_supported);
}

TORCH_LIBRARY_IMPL(core_cpu_gemv, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_mm_pair", &int4_mm_pair);
  m.impl("int8_mm_pair", &int8_mm_pair);
}
