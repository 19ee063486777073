// Paged attention on CPU, reading K/V in place from the pool through each sequence's slot row.
//
// One op, torch.ops.core_cpu.paged_attention, for decode and extend alike: the queries of
// sequence b are its extend_lens[b] newest tokens (rows of q, back to back in batch order), at
// positions seq_lens[b] - extend_lens[b] ... seq_lens[b] - 1, and each attends causally to the
// keys at slots kv_indices[b, 0 .. pos] (the last `window` of them when window > 0). A task is
// (sequence, KV head, a few query tokens): the query heads sharing that KV head go together, so
// every key row read from the pool serves all of them. Decodes of a bf16 pool (AVX512-BF16) or a
// float32 pool (AVX2), when there are enough sequences to keep the threads busy, take all KV heads
// of a sequence in one task, so that each slot's whole K and V rows are read at once; with too
// few (fewer than two tasks per thread), each decode's keys split into parts, merged afterwards.
// Keys stream in blocks with an online softmax in fp32; on CPUs with AVX512-BF16, q . k of a
// bf16 pool multiplies the bf16 rows directly (exact products summed in fp32; the keys are never
// converted), and every query token of a bf16 pool (decode or extend, no soft cap; head dims of 16,
// 32, 64 and 128) runs decode_bf16: all its scores over a chunk of up to 256 keys, one softmax over them, then the V
// rows; decodes of a float32 pool run its AVX2 twin, decode_f32. Extends of the other pools
// (extend_tiled) hold the task's query vectors side by side in the lanes (transposed once per
// task): per block of 32 keys, every key row as it lies in the pool is broadcast against them, so
// the scores, the softmax (exp is a polynomial) and the V weighting are all register tiles of
// vectors of the -march=native width (AVX2 or AVX-512), with no transposition of keys and no
// horizontal sums; a head dim of no whole number of vectors takes a scalar loop. Tasks run on
// torch's OpenMP pool, dynamically scheduled (sequences differ in length), with
// torch.get_num_threads() threads.
//
// The kernel itself is kernels/cpu_attention.h (the one-call decoder stack, kernels/cpu_decode.cpp,
// runs it too); this file is the op around it.

#include "cpu_attention.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

using namespace core_attention;

template <typename T, int DC>
void run_all(const Work& w, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out) {
  const T* qp = q.const_data_ptr<T>();
  const T* kp = kc.const_data_ptr<T>();
  const T* vp = vc.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int nt = static_cast<int>(std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(w.tasks.size())));
#pragma omp parallel num_threads(nt) if (nt > 1)
  run_tasks<T, DC>(w, qp, kp, vp, op);
}

template <typename T>
void dispatch_dim(const Work& w, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out) {
  switch (w.p.D) {
    case 16: return run_all<T, 16>(w, q, kc, vc, out);
    case 32: return run_all<T, 32>(w, q, kc, vc, out);
    case 64: return run_all<T, 64>(w, q, kc, vc, out);
    case 128: return run_all<T, 128>(w, q, kc, vc, out);
    default: return run_all<T, 0>(w, q, kc, vc, out);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& kv_indices, const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                           double scale, int64_t window, double cap, bool batch_invariant) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [T, H, D] and caches [slots, Hkv, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches and each row of q must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must have one dtype");
  TORCH_CHECK(kv_indices.dim() == 2 && kv_indices.stride(1) == 1 && kv_indices.scalar_type() == at::kLong,
              "kv_indices must be int64 [B, max_len] with contiguous rows");
  TORCH_CHECK(seq_lens.is_contiguous() && extend_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong &&
                  extend_lens.scalar_type() == at::kLong,
              "seq_lens and extend_lens must be contiguous int64");
  const int64_t B = seq_lens.numel(), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(extend_lens.numel() == B && kv_indices.size(0) == B, "one seq_len, extend_len and slot row per sequence");
  TORCH_CHECK(k_cache.size(2) == D && H % Hkv == 0, "head_dim or head counts disagree between q and the caches");
  Work w;
  plan(w, B, seq_lens.const_data_ptr<int64_t>(), extend_lens.const_data_ptr<int64_t>(), kv_indices.const_data_ptr<int64_t>(),
       kv_indices.stride(0), kv_indices.size(1), q.size(0), q.stride(0), H, Hkv, D, q.scalar_type(),
       scale, window, cap, at::get_num_threads(), batch_invariant);
  at::Tensor out = at::empty({q.size(0), H, D}, q.options());
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_dim<float>(w, q, k_cache, v_cache, out); break;
    case at::kBFloat16: dispatch_dim<c10::BFloat16>(w, q, k_cache, v_cache, out); break;
    case at::kHalf: dispatch_dim<c10::Half>(w, q, k_cache, v_cache, out); break;
    default: TORCH_CHECK(false, "paged_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(core_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indices, Tensor seq_lens, "
        "Tensor extend_lens, float scale, int window, float cap, bool batch_invariant=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(core_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
