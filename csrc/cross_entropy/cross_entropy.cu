// Fused softmax cross-entropy over a chunk of logits (fp32, bf16 or fp16; fp32 arithmetic), on CUDA: per row r
// of x [C, V]
//
//   lse     = max(x) + log(sum(exp(x - max(x))))
//   nll[r]  = valid[r] ? lse - x[target[r]] : 0
//   grad[r] = (exp(x - lse) - onehot(target[r])) * scale[r]      (only when grad is given; cast once)
//
// The nll is computed as torch's log_softmax does, log_sum - (x[t] - max): lse itself, rounded at the magnitude
// of the logits, would cost large logits (~1000) about 1e-4 absolute. The gradient is exp(x - max) * (scale /
// sum), and its target element (exp(x_t - max) / sum - 1) * scale: no log_sum in the exponent, so each
// probability carries the rounding of x - max (exact for 16-bit logits) and of its own exp, not that of
// (x - max) - log_sum at the magnitude of log_sum.
// Every exp of the row is one MUFU.EX2 of (x - max) * log2(e) (exp_shifted): at most 2^-22 relative from the
// SFU, plus the product's rounding, 2^-24 |x - max| log2(e) relative, which is what rounding x - max - log_sum
// already cost the libm expf form, and small where the probability is not. libm's expf (range reduction, then
// the same MUFU, then a rescale: ~9 instructions) made this kernel issue-bound, 40 SASS instructions an element
// in the register kernel; now ~14. On the H200 (benchmarks/diagnose_cross_entropy.py, both builds in one run,
// results/diagnose_cross_entropy_bfcb015.log) the bf16 chunk (C = 2048, V = 32000, bf16 gradient) went from 117.4
// to 89.0 us (69% of copy: its bytes take ~61 us), fp32 logits 161.8 to 144.8, V = 128256 and 151936 (streaming)
// 12-13% faster; the errors against fp64 are torch's own fp32 log_softmax's. The running (max, sum) rescales keep
// libm's expf: they are a few per thread, and their argument can be any size.
//
// One thread block per row (a 1-D grid of C blocks, so C may reach 2^31 - 1). Pass 1 reads the row once with a
// per-thread online (max, sum) and reduces the pairs over the block; pass 2 reads the row again, back to front so
// that it starts with what pass 1 read last, which L2 most likely still holds, and writes the gradient. The block
// size shrinks with V, so small vocabularies do not idle 512 threads per row.
// Rows of at most kRegGroups vectors per thread take cross_entropy_regs_kernel instead: one read, the row kept in
// registers (see there). The streaming kernel handles longer rows, fp32 rows beyond 16384, and the scalar
// (misaligned) path. Before the exp change, the register kernel took 115 us for the bf16 chunk where streaming
// took 131 us, and fp32 logits took 156 us against 93 us for a plain copy of their bytes; blocks of 256 or 1024
// threads were slower at V = 32000 and V = 152064. 16-bit logits (what the unfused path of a bf16 model computes:
// its logits GEMM writes bf16) are read 16 bytes (8 values) at a time, half the bytes of fp32 per row.
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "cross_entropy_checks.h"
#include "lf_cuda_utils.cuh"

namespace loongforge {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;
constexpr int kVecsPerThread = 8;  // below this many elements (or float4s) per thread a smaller block is chosen

constexpr float kLog2e = 1.4426950408889634f;

// exp(d) for d = x - max <= 0 (or -inf, giving 0; nan stays nan): one FMUL and one MUFU.EX2. ex2.approx.ftz flushes
// results below 2^-126 to zero, which a probability times a scale of order 1 rounds to anyway in every output dtype.
__device__ __forceinline__ float exp_shifted(float d) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(d * kLog2e));
    return e;
}

struct MaxSum {
    float max, sum;  // sum of exp(x - max) over the elements seen; (-inf, 0) before any finite one
};

__device__ __forceinline__ void merge(MaxSum& a, const MaxSum& b) {
    const float m = fmaxf(a.max, b.max);
    if (m == -INFINITY) return;  // both empty (or all -inf): exp(-inf - -inf) would be nan
    a.sum = a.sum * expf(a.max - m) + b.sum * expf(b.max - m);
    a.max = m;
}

// Adds N values that arrived together: one rescale of the running sum at most, then N exps. A group of -inf
// adds nothing; a nan makes the sum nan, as in PyTorch.
template <int N>
__device__ __forceinline__ void add_values(MaxSum& acc, const float (&v)[N]) {
    float m = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j) m = fmaxf(m, v[j]);
    if (m > acc.max) {
        acc.sum *= expf(acc.max - m);
        acc.max = m;
    }
    if (m == -INFINITY) return;
#pragma unroll
    for (int j = 0; j < N; ++j) acc.sum += exp_shifted(v[j] - acc.max);
}

// Every thread returns the block's (max, sum); the merge order is fixed, so results are deterministic. A barrier
// (of the warp, in a one-warp block) orders every read of the logits before it ahead of every gradient store after it.
__device__ __forceinline__ MaxSum block_max_sum(MaxSum v, MaxSum* smem) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        merge(v, MaxSum{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)});
    }
    const int warps = blockDim.x >> 5;
    if (warps == 1) {
        __syncwarp();
        return v;
    }
    if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = v;
    __syncthreads();
    MaxSum total = smem[0];
    for (int w = 1; w < warps; ++w) merge(total, smem[w]);
    return total;
}

struct RowEnd {
    float max, inv_sum;  // the row's max and 1 / sum(exp(x - max)): what the gradient needs
};

// The gradient of W consecutive logits starting at element `first`: exp(x - max) * (scale / sum), and for the target
// (exp(x_t - max) / sum - 1) * scale. The target test is one comparison a group, not one an element.
template <typename G, int W>
__device__ __forceinline__ Vec<G, W> grad_group(const float (&v)[W], const RowEnd& row, float s, float s_over_sum,
                                                int64_t first, int64_t t) {
    Vec<G, W> out;
    if (t >= first && t < first + W) {
#pragma unroll
        for (int j = 0; j < W; ++j) {
            const float e = exp_shifted(v[j] - row.max);
            out.val[j] = static_cast<G>(first + j == t ? (e * row.inv_sum - 1.f) * s : e * s_over_sum);
        }
    } else {
#pragma unroll
        for (int j = 0; j < W; ++j) out.val[j] = static_cast<G>(exp_shifted(v[j] - row.max) * s_over_sum);
    }
    return out;
}

// A row's end, shared by both kernels: the block's (max, sum of exp), thread 0's nll write (valid and nll point at
// this row's entries), and the max and 1 / sum for the gradient. x[t] is read before the block's reduction, whose
// barrier orders it before the gradient's stores: the gradient may be written into the logits themselves (grad_CV
// = logits_CV, as the CPU kernel and the reference allow), and read after it, x[t] raced with the store of another
// warp's thread into it (the nll then took the gradient's value).
template <typename X>
__device__ __forceinline__ RowEnd finish_row(const MaxSum& acc, MaxSum* smem, const X* __restrict__ x, int64_t t,
                                             int64_t vocab, const bool* valid, float* nll) {
    float x_t = 0.f;
    if (threadIdx.x == 0) {
        CUDA_KERNEL_ASSERT(t >= 0 && t < vocab);
        x_t = static_cast<float>(x[t]);
    }
    const MaxSum row = block_max_sum(acc, smem);
    if (threadIdx.x == 0) *nll = *valid ? logf(row.sum) - (x_t - row.max) : 0.f;
    return RowEnd{row.max, 1.f / row.sum};
}

// W consecutive logits of group i, as fp32: one 16-byte load on the vector path (W = 16 / sizeof(X)).
template <typename X, int W>
__device__ __forceinline__ void load_group(const X* __restrict__ x, int64_t i, float (&v)[W]) {
    if constexpr (W == 1) {
        v[0] = static_cast<float>(x[i]);
    } else {
        const Vec<X, W> q = load_vec<X, W>(x + i * W);
#pragma unroll
        for (int j = 0; j < W; ++j) v[j] = static_cast<float>(q.val[j]);
    }
}

// Logit j of a 16-byte vector of X held as raw words, as fp32 (j is a compile-time index after unrolling). The
// register-resident kernel keeps its row as raw words, not converted values: see there.
template <typename X>
__device__ __forceinline__ float lane(const uint4& v, int j) {
    constexpr int per_word = 4 / static_cast<int>(sizeof(X));
    const int k = j / per_word;
    const uint32_t word = k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
    if constexpr (per_word == 1) {
        return __uint_as_float(word);
    } else {
        const uint32_t bits = (j % 2) ? (word >> 16) : (word & 0xffffu);  // little-endian: element 0 is the low half
        if constexpr (std::is_same_v<X, c10::BFloat16>) {
            return __uint_as_float(bits << 16);  // bf16 is the top half of an fp32
        } else {
            return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
        }
    }
}

// Values per 16-byte vector of logits: 4 fp32, 8 bf16/fp16.
template <typename X>
constexpr int vec_width() {
    return static_cast<int>(16 / sizeof(X));
}

// Preconditions (checked by check_cross_entropy_args and the launcher): blockDim.x is a multiple of 32 and at
// most kMaxThreads; 1 <= V < 2^31; 0 <= target[r] < V (asserted on the device, as torch's gather does);
// x rows are `x_stride` elements apart, grad rows `grad_stride` elements apart (grad == nullptr: no gradient).
// VEC (16-byte loads of W = vec_width<X>() logits, W-element stores) additionally needs V % W == 0, both strides
// % W == 0, x 16-byte and grad min(16, W * sizeof(G))-byte aligned; otherwise the scalar path handles any V and any
// alignment.
// Each thread issues kUnroll independent loads before using them: with one load in flight per thread the H200
// took 175 us instead of 97 us at C = 256, V = 152064, and 310 us instead of 221 us on the scalar path (V = 32003).
template <typename X, typename G, bool VEC>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_kernel(const X* __restrict__ x_all, int64_t x_stride, const int64_t* __restrict__ target,
                         const bool* __restrict__ valid, const float* __restrict__ scale, float* __restrict__ nll,
                         G* __restrict__ grad_all, int64_t grad_stride, int64_t vocab) {
    constexpr int W = VEC ? vec_width<X>() : 1;
    __shared__ MaxSum smem[kMaxThreads / 32];
    const int64_t r = blockIdx.x;
    const X* x = x_all + r * x_stride;
    const int64_t t = target[r];
    const int64_t n = vocab / W;
    const int64_t step = blockDim.x;

    MaxSum acc{-INFINITY, 0.f};
    for (int64_t i0 = threadIdx.x; i0 < n; i0 += kUnroll * step) {
        float v[kUnroll][W];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (i0 + u * step < n) {
                load_group<X, W>(x, i0 + u * step, v[u]);
            } else {
#pragma unroll
                for (int j = 0; j < W; ++j) v[u][j] = -INFINITY;  // adds nothing
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) add_values<W>(acc, v[u]);
    }
    const RowEnd row = finish_row<X>(acc, smem, x, t, vocab, valid + r, nll + r);
    if (grad_all == nullptr) return;

    const float s = scale[r];
    const float s_over_sum = s * row.inv_sum;
    G* g = grad_all + r * grad_stride;
    for (int64_t i0 = n - 1 - threadIdx.x; i0 >= 0; i0 -= kUnroll * step) {
        float v[kUnroll][W];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (i0 - u * step >= 0) load_group<X, W>(x, i0 - u * step, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = i0 - u * step;
            if (i < 0) break;
            store_vec<G, W>(g + i * W, grad_group<G, W>(v[u], row, s, s_over_sum, i * W, t));
        }
    }
}

// The row held in registers: when a row is at most kRegGroups vectors per thread (bf16/fp16 up to V = 32768 with
// 512 threads, fp32 up to 16384), each thread keeps its loaded vectors (kRegGroups x 16 bytes = 32 registers)
// through the block reduction and computes the gradient from them, so the row is read from memory once, where the
// streaming kernel above reads it twice. Same preconditions as the VEC path; each thread visits its groups in the
// streaming kernel's order (threadIdx.x, + blockDim.x, ...), so for a given block size both give the same bits.
constexpr int kRegGroups = 8;

template <typename X, typename G>
__global__ void __launch_bounds__(kMaxThreads, 2)  // <= 64 registers: two 512-thread rows per SM
    cross_entropy_regs_kernel(const X* __restrict__ x_all, int64_t x_stride, const int64_t* __restrict__ target,
                              const bool* __restrict__ valid, const float* __restrict__ scale,
                              float* __restrict__ nll, G* __restrict__ grad_all, int64_t grad_stride, int64_t vocab) {
    constexpr int W = vec_width<X>();
    __shared__ MaxSum smem[kMaxThreads / 32];
    const int64_t r = blockIdx.x;
    const X* x = x_all + r * x_stride;
    const int64_t t = target[r];
    const int n = static_cast<int>(vocab / W);  // <= kRegGroups * kMaxThreads
    const int step = blockDim.x;

    uint4 q[kRegGroups];  // the row's vectors as raw words
#pragma unroll
    for (int u = 0; u < kRegGroups; ++u) {
        const int i = threadIdx.x + u * step;
        q[u] = i < n ? *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(i) * W) : make_uint4(0, 0, 0, 0);
    }
    MaxSum acc{-INFINITY, 0.f};
#pragma unroll
    for (int u = 0; u < kRegGroups; ++u) {
        if (threadIdx.x + u * step < n) {
            float v[W];
#pragma unroll
            for (int j = 0; j < W; ++j) v[j] = lane<X>(q[u], j);
            add_values<W>(acc, v);
        }
    }
    const RowEnd row = finish_row<X>(acc, smem, x, t, vocab, valid + r, nll + r);
    if (grad_all == nullptr) return;

    // Opaque to the compiler from here: it converts the raw words again instead of keeping all W * kRegGroups
    // converted values alive across the reduction (for bf16 that took 96 registers, or spilled under the bound).
#pragma unroll
    for (int u = 0; u < kRegGroups; ++u) asm volatile("" : "+r"(q[u].x), "+r"(q[u].y), "+r"(q[u].z), "+r"(q[u].w));
    const float s = scale[r];
    const float s_over_sum = s * row.inv_sum;
    G* g = grad_all + r * grad_stride;
#pragma unroll
    for (int u = 0; u < kRegGroups; ++u) {
        const int i = threadIdx.x + u * step;
        if (i >= n) break;
        float v[W];
#pragma unroll
        for (int j = 0; j < W; ++j) v[j] = lane<X>(q[u], j);
        store_vec<G, W>(g + static_cast<int64_t>(i) * W,
                        grad_group<G, W>(v, row, s, s_over_sum, static_cast<int64_t>(i) * W, t));
    }
}

int threads_for(int64_t units_per_row) {
    int threads = 32;
    while (threads < kMaxThreads && static_cast<int64_t>(threads) * kVecsPerThread < units_per_row) threads <<= 1;
    return threads;
}

// out = x * scale[0] in fp32, rounded once: the LM head backward's scaling by the incoming gradient (a device
// scalar), which torch ran as a generic broadcast kernel of mixed dtypes at ~1 TB/s on the H200. 16 bytes a
// thread and iteration where x and out are 16-byte aligned, else one element.
constexpr int kScaleThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kScaleThreads)
    scale_by_kernel(const T* __restrict__ x, int64_t n, const float* __restrict__ scale, T* __restrict__ out,
                    bool vectorized) {
    constexpr int V = 16 / sizeof(T);
    const float s = *scale;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t n_vec = vectorized ? n / V : 0;
    for (int64_t k = first; k < n_vec; k += stride) {
        Vec<T, V> v = load_vec<T, V>(x + k * V);
#pragma unroll
        for (int j = 0; j < V; ++j) v.val[j] = static_cast<T>(static_cast<float>(v.val[j]) * s);
        store_vec<T, V>(out + k * V, v);
    }
    for (int64_t i = n_vec * V + first; i < n; i += stride) out[i] = static_cast<T>(static_cast<float>(x[i]) * s);
}

}  // namespace

at::Tensor cross_entropy_cuda(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& valid,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& grad) {
    check_cross_entropy_args(logits, target, valid, scale, grad, c10::DeviceType::CUDA);
    const int64_t rows = logits.size(0);
    const int64_t vocab = logits.size(1);
    LF_CHECK(rows <= std::numeric_limits<int32_t>::max(), "cross_entropy: at most 2^31 - 1 rows per call (one ",
             "block per row), got ", rows, "; split the rows into chunks");
    const c10::cuda::CUDAGuard guard(logits.device());
    auto nll = at::empty({rows}, logits.options().dtype(at::kFloat));
    if (rows == 0) return nll;
    const bool with_grad = grad.has_value() && grad->defined();
    const at::ScalarType grad_type = with_grad ? grad->scalar_type() : at::kFloat;
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(logits.scalar_type(), "cross_entropy", [&] {
        using X = scalar_t;
        constexpr int W = vec_width<X>();
        LF_DISPATCH_FLOATING(grad_type, "cross_entropy", [&] {
            using G = scalar_t;
            G* g = with_grad ? grad->data_ptr<G>() : nullptr;
            const int64_t g_stride = with_grad ? grad->stride(0) : 0;
            const uintptr_t g_align = W * sizeof(G) < 16 ? W * sizeof(G) : 16;
            const bool vec_ok = vocab % W == 0 && logits.stride(0) % W == 0 && lf_aligned16(logits.data_ptr()) &&
                                (!with_grad || (g_stride % W == 0 && reinterpret_cast<uintptr_t>(g) % g_align == 0));
            auto launch = [&]<bool VEC>() {
                const int threads = threads_for(VEC ? vocab / W : vocab);
                if (VEC && vocab / W <= static_cast<int64_t>(threads) * kRegGroups) {
                    cross_entropy_regs_kernel<X, G><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
                        logits.data_ptr<X>(), logits.stride(0), target.data_ptr<int64_t>(), valid.data_ptr<bool>(),
                        scale.data_ptr<float>(), nll.data_ptr<float>(), g, g_stride, vocab);
                    return;
                }
                cross_entropy_kernel<X, G, VEC><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
                    logits.data_ptr<X>(), logits.stride(0), target.data_ptr<int64_t>(), valid.data_ptr<bool>(),
                    scale.data_ptr<float>(), nll.data_ptr<float>(), g, g_stride, vocab);
            };
            if (vec_ok) launch.template operator()<true>();
            else launch.template operator()<false>();
            LF_CUDA_CHECK_LAUNCH();
        });
    });
    return nll;
}

void scale_by_cuda(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& out) {
    const int64_t n = x.numel();
    if (n == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    auto stream = c10::cuda::getCurrentCUDAStream();
    const bool vectorized = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                            reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
    const int64_t per_block = static_cast<int64_t>(kScaleThreads) * (16 / x.element_size());
    const int64_t wanted = (n + per_block - 1) / per_block;
    const int blocks = static_cast<int>(wanted < 8192 ? wanted : 8192);
    LF_DISPATCH_FLOATING(x.scalar_type(), "scale_by", [&] {
        using T = scalar_t;
        scale_by_kernel<T><<<blocks, kScaleThreads, 0, stream>>>(x.data_ptr<T>(), n, scale.data_ptr<float>(),
                                                               out.data_ptr<T>(), vectorized);
        LF_CUDA_CHECK_LAUNCH();
    });
}

}  // namespace loongforge
