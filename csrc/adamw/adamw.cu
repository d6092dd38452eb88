// Fused AdamW + global-norm clip on CUDA: multi-tensor launches over a bucket's device table
// (adamw_common.h), 16-byte vector access where every tensor of an entry is 16-byte aligned.
//
// Pass 1 (sumsq_kernel): block b reads chunks b, b + grid, ... of every gradient once and writes one
// partial sum of squares and one non-finite flag; reduce_kernel adds the partials of all buckets in a fixed
// order (no float atomics), so the norm is bitwise reproducible. Pass 2 (adamw_kernel): every block reads
// stats from device memory, returns at once when a gradient was non-finite, else applies the clipped AdamW
// update to one chunk with the step count + 1 of its tensor; bump_steps_kernel then advances the counts
// (after every block has read them). The host never reads a device value.
#include <type_traits>

#include "adamw_common.h"
#include "lf_cuda_utils.cuh"

namespace loongforge {
namespace adamw {
namespace {

constexpr int kThreads = 512;
constexpr int kReduceThreads = 1024;
// The update's block size, resident blocks asked of ptxas (__launch_bounds__'s second argument: it caps the
// registers so that many fit on an SM) and elements per thread and step. Macros so that
// benchmarks/diagnose_adamw.py can build and time variants side by side. Unset, the bound names no block count,
// as before the macros: a count of 1 is not the same, it let ptxas take 84-86 registers where the kernel has 70
// (both one 512-thread block an SM). On the H200 (030a37f, that 84-register build as "base") the default shape ran
// the e2e workload at 95.3% of copy; 64-register builds with twice the resident warps ran 7-10% slower, 4 elements
// a thread 1% slower. The 70-register kernel ran at 94% in the f456232 e2e trace.
#ifndef LF_ADAMW_THREADS
#define LF_ADAMW_THREADS 512
#endif
#ifdef LF_ADAMW_MIN_BLOCKS
#define LF_ADAMW_UPDATE_BOUNDS __launch_bounds__(kUpdateThreads, LF_ADAMW_MIN_BLOCKS)
#else
#define LF_ADAMW_UPDATE_BOUNDS __launch_bounds__(kUpdateThreads)
#endif
#ifndef LF_ADAMW_VEC
#define LF_ADAMW_VEC 8
#endif
constexpr int kUpdateThreads = LF_ADAMW_THREADS;

struct Chunk {
    const int64_t* entry;
    int64_t begin, n;
};

__device__ __forceinline__ Chunk chunk_at(const int64_t* __restrict__ table, const TableHeader& h, int64_t c) {
    const int64_t* entries = table + kHeader;
    const int64_t word = entries[h.n_tensors * kEntry + c];
    const int64_t* e = entries + (word >> 32) * kEntry;
    const int64_t begin = (word & 0xffffffff) * h.chunk_size;
    const int64_t left = e[kNumel] - begin;
    return {e, begin, left < h.chunk_size ? left : h.chunk_size};
}

template <typename T>
__device__ __forceinline__ T* ptr(const int64_t* e, Field f) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(e[f]));
}

template <typename G>
__global__ void __launch_bounds__(kThreads) sumsq_kernel(const int64_t* __restrict__ table, TableHeader h,
                                                         float* __restrict__ partials, float* __restrict__ flags) {
    constexpr int V = 16 / sizeof(G);
    __shared__ float smem[32];
    float acc = 0.f;
    int bad = 0;
    for (int64_t c = blockIdx.x; c < h.n_chunks; c += gridDim.x) {
        const Chunk ch = chunk_at(table, h, c);
        const G* g = ptr<const G>(ch.entry, kGrad) + ch.begin;
        const int64_t n_vec = ch.entry[kVecOk] ? ch.n / V : 0;
        for (int64_t k = threadIdx.x; k < n_vec; k += blockDim.x) {
            const Vec<G, V> x = load_vec<G, V>(g + k * V);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float f = static_cast<float>(x.val[j]);
                acc += f * f;
                bad |= !::isfinite(f);
            }
        }
        for (int64_t i = n_vec * V + threadIdx.x; i < ch.n; i += blockDim.x) {
            const float f = static_cast<float>(g[i]);
            acc += f * f;
            bad |= !::isfinite(f);
        }
    }
    acc = row_allreduce_sum(acc, smem, blockDim.x);
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = acc;
        flags[blockIdx.x] = bad ? 1.f : 0.f;
    }
}

__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(const float* __restrict__ partials,
                                                                const float* __restrict__ flags, int64_t n,
                                                                float* __restrict__ stats) {
    __shared__ float smem[32];
    float acc = 0.f, bad = 0.f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        acc += partials[i];
        bad += flags[i];
    }
    acc = row_allreduce_sum(acc, smem, blockDim.x);
    bad = row_allreduce_sum(bad, smem, blockDim.x);
    if (threadIdx.x == 0) {
        stats[0] = acc;
        stats[1] = bad;
    }
}

template <typename P, typename G, bool kHasMaster>
__device__ __forceinline__ void update_one(P* param, float* master, const G* grad, float* m, float* v, int64_t i,
                                           float scale, const StepScalars& sc) {
    float p = kHasMaster ? master[i] : static_cast<float>(param[i]);
    adamw_element(p, m[i], v[i], static_cast<float>(grad[i]) * scale, sc);
    if (kHasMaster) master[i] = p;
    param[i] = static_cast<P>(p);
}

template <typename P, typename G, bool kHasMaster>
__global__ void LF_ADAMW_UPDATE_BOUNDS
    adamw_kernel(const int64_t* __restrict__ table, TableHeader h, const float* __restrict__ stats,
                 const float* __restrict__ inv_scale_dev, Hyper hp) {
    // 32 bytes of every fp32 stream (two 128-bit accesses) and 16 of a bf16/fp16 one per thread and iteration:
    // with V = 4 (8-byte bf16 accesses) the bf16 + fp32-master update ran at ~94% of copy bandwidth on the H200
    constexpr int V = LF_ADAMW_VEC;
    if (stats[1] != 0.f) return;
    const float scale = grad_scale(hp, stats[0], inv_scale_dev != nullptr ? *inv_scale_dev : 1.f);
    for (int64_t c = blockIdx.x; c < h.n_chunks; c += gridDim.x) {
        const Chunk ch = chunk_at(table, h, c);
        const int64_t* e = ch.entry;
        const StepScalars sc = step_scalars(hp, *ptr<const float>(e, kStep) + 1.f);
        P* param = ptr<P>(e, kParam) + ch.begin;
        float* master = kHasMaster ? ptr<float>(e, kMaster) + ch.begin : nullptr;
        const G* grad = ptr<const G>(e, kGrad) + ch.begin;
        float* m = ptr<float>(e, kExpAvg) + ch.begin;
        float* v = ptr<float>(e, kExpAvgSq) + ch.begin;
        const int64_t n_vec = e[kVecOk] ? ch.n / V : 0;
        for (int64_t k = threadIdx.x; k < n_vec; k += blockDim.x) {
            const int64_t i = k * V;
            const Vec<G, V> g = load_vec<G, V>(grad + i);
            Vec<float, V> mv = load_vec<float, V>(m + i);
            Vec<float, V> vv = load_vec<float, V>(v + i);
            Vec<float, V> pf;
            Vec<P, V> pv;
            if constexpr (kHasMaster) {
                pf = load_vec<float, V>(master + i);
            } else {
                pv = load_vec<P, V>(param + i);
#pragma unroll
                for (int j = 0; j < V; ++j) pf.val[j] = static_cast<float>(pv.val[j]);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) {
                adamw_element(pf.val[j], mv.val[j], vv.val[j], static_cast<float>(g.val[j]) * scale, sc);
                pv.val[j] = static_cast<P>(pf.val[j]);
            }
            if constexpr (kHasMaster) store_vec<float, V>(master + i, pf);
            store_vec<P, V>(param + i, pv);
            store_vec<float, V>(m + i, mv);
            store_vec<float, V>(v + i, vv);
        }
        for (int64_t i = n_vec * V + threadIdx.x; i < ch.n; i += blockDim.x) {
            update_one<P, G, kHasMaster>(param, master, grad, m, v, i, scale, sc);
        }
    }
}

__global__ void bump_steps_kernel(const int64_t* __restrict__ table, int64_t n_tensors,
                                  const float* __restrict__ stats) {
    const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (t >= n_tensors || stats[1] != 0.f) return;
    *ptr<float>(table + kHeader + t * kEntry, kStep) += 1.f;
}

}  // namespace

void sumsq_partials_cuda(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& partials,
                         const at::Tensor& flags) {
    const c10::cuda::CUDAGuard guard(dev_table.device());
    auto stream = c10::cuda::getCurrentCUDAStream();
    dispatch_code(h.grad_dtype, "grad", [&](auto g_tag) {
        using G = decltype(g_tag);
        sumsq_kernel<G><<<partials.numel(), kThreads, 0, stream>>>(dev_table.data_ptr<int64_t>(), h,
                                                                  partials.data_ptr<float>(), flags.data_ptr<float>());
        LF_CUDA_CHECK_LAUNCH();
    });
}

void reduce_partials_cuda(const at::Tensor& partials, const at::Tensor& flags, const at::Tensor& stats) {
    const c10::cuda::CUDAGuard guard(stats.device());
    reduce_kernel<<<1, kReduceThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        partials.data_ptr<float>(), flags.data_ptr<float>(), partials.numel(), stats.data_ptr<float>());
    LF_CUDA_CHECK_LAUNCH();
}

void adamw_update_cuda(const TableHeader& h, const at::Tensor& dev_table, const at::Tensor& stats,
                       const float* inv_scale_dev, const Hyper& hp) {
    const c10::cuda::CUDAGuard guard(dev_table.device());
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t* table = dev_table.data_ptr<int64_t>();
    const float* s = stats.data_ptr<float>();
    const unsigned grid = static_cast<unsigned>(h.n_chunks < (int64_t{1} << 30) ? h.n_chunks : (int64_t{1} << 30));
    dispatch_code(h.param_dtype, "param", [&](auto p_tag) {
        using P = decltype(p_tag);
        // make_table admits grads of the param dtype or float32, and master weights only for low-precision
        // params: 9 instantiations instead of 18.
        auto launch = [&](auto g_tag) {
            using G = decltype(g_tag);
            if constexpr (std::is_same_v<P, float>) {
                adamw_kernel<float, float, false><<<grid, kUpdateThreads, 0, stream>>>(table, h, s, inv_scale_dev, hp);
            } else if (h.has_master) {
                adamw_kernel<P, G, true><<<grid, kUpdateThreads, 0, stream>>>(table, h, s, inv_scale_dev, hp);
            } else {
                adamw_kernel<P, G, false><<<grid, kUpdateThreads, 0, stream>>>(table, h, s, inv_scale_dev, hp);
            }
            LF_CUDA_CHECK_LAUNCH();
        };
        if (h.n_chunks == 0) return;  // zero-size tensors only: no update grid (an empty grid is a launch error)
        if (h.grad_dtype == kF32) launch(float{});
        else launch(P{});
    });
    const int threads = 256;
    bump_steps_kernel<<<static_cast<unsigned>((h.n_tensors + threads - 1) / threads), threads, 0, stream>>>(
        table, h.n_tensors, s);
    LF_CUDA_CHECK_LAUNCH();
}

}  // namespace adamw
}  // namespace loongforge
