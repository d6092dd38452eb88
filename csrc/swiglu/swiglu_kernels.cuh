// Fused SwiGLU + dropout on the concatenated gate/up projection, on CUDA.
//
//   gate_up[n, :] = [gate (I) | up (I)]          (one GEMM with weight [2I, H] produced it)
//   out[n, i]     = silu(gate) * up * keep(e) / (1 - p),   e = n * I + i
//   keep(e)       = Philox4x32-10(counter = (e / 4, offset), key = seed)[e % 4] < (1 - p) * 2^32
//   backward:     dz = dout * keep / (1 - p);  s = sigmoid(gate)
//                 dgate = dz * up * s * (1 + gate * (1 - s)),  dup = dz * gate * s
//
// The mask is never stored: backward regenerates it from (seed, offset). With p == 0 the kernels are
// instantiated without any RNG. Arithmetic is fp32; where it rounds depends on the `stock` flag:
//   once  (stock == false): one rounding per output, the formulas above.
//   stock (stock == true, the op's default): rounds where transformers' eager `act_fn(gate) * up` and its
//         autograd round (rnd = lf_round_to<T>, fp32 -> T -> fp32; scale = 1 / (1 - p)):
//         forward:  a = rnd(gate / (1 + exp(-gate)));  h = rnd(a * up);  out = keep ? rnd(h * scale) : 0
//         backward: dh = keep ? rnd(dout * scale) : 0;  dup = rnd(dh * a)
//                   dgate = rnd(rnd(dh * up) * s * (1 + gate * (1 - s)))   (torch's silu_backward)
//         Float32 activations run the once code under both flags (every rnd would be the identity), so
//         their results do not depend on the flag. Here exp is __expf and division approximate (--use_fast_math)
//         where torch's eager kernels use expf and IEEE division: measured on an H200, stock differs from eager
//         on <= 4e-4 of fp16 elements (rnd(silu) one unit off, up to 3 units after the products) and <= 2e-5
//         of bf16 ones (1 unit). Exact expf and division matched eager bit for bit but made the stock kernels
//         compute-bound (+80% forward time at p = 0 in fp16).
// The flag is a kernel argument (a uniform branch), not a template parameter of the kernels, so the JIT build
// compiles no more kernels; the float32 instantiations drop the stock branch at compile time.
// Preconditions of the vector path: I % V == 0 and 16-byte-aligned rows (V = 16 / sizeof(T)); each
// thread then handles V adjacent outputs of one row, i.e. V/4 whole Philox blocks. Otherwise a
// scalar path handles any I.
// Kernels and launch helpers shared by the forward and backward translation units (compiled in
// parallel by ninja, which keeps the cold JIT build short).
#pragma once

#include "lf_cuda_utils.cuh"
#include "swiglu_checks.h"

namespace loongforge {
namespace {

constexpr int kThreads = 256;

struct DropoutArgs {
    uint64_t seed;
    uint64_t offset;
    uint32_t keep_threshold;
    float scale;
};

// keep bits for V adjacent flat elements starting at e0 (e0 % 4 == 0 when V >= 4).
template <int V>
__device__ __forceinline__ void keep_bits(const DropoutArgs& d, uint64_t e0, bool (&keep)[V]) {
    if constexpr (V >= 4) {
#pragma unroll
        for (int b = 0; b < V / 4; ++b) {
            const Philox4 r = dropout_words(d.seed, d.offset, e0 / 4 + b);
#pragma unroll
            for (int j = 0; j < 4; ++j) keep[b * 4 + j] = r.v[j] < d.keep_threshold;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const uint64_t e = e0 + j;
            const Philox4 r = dropout_words(d.seed, d.offset, e / 4);
            keep[j] = r.v[e % 4] < d.keep_threshold;
        }
    }
}

__device__ __forceinline__ float sigmoidf_fast(float x) { return 1.f / (1.f + __expf(-x)); }

// silu as torch computes it, x / (1 + exp(-x)): the stock rounding rounds this value to T, and the product
// x * sigmoid(x) (two fp32 roundings) would round to a different T value for ~1e-4 of fp16 inputs.
__device__ __forceinline__ float siluf_fast(float x) { return x / (1.f + __expf(-x)); }

// Whether the stock rounding differs from once for T: only 16-bit activations round intermediates.
template <typename T>
constexpr bool kRoundsIntermediates = sizeof(T) < sizeof(float);

// The forward's row loop of one rounding. The kernel's flag picks one of the two loops (a uniform branch taken
// once per thread), so each is scheduled on its own: the once loop compiles to the code it had before the flag
// existed (a branch per element cost the once path 8-11% with dropout on the H200).
template <typename T, int V, bool DROPOUT, bool STOCK>
__device__ __forceinline__ void swiglu_fwd_rows(const T* __restrict__ gate_up, int64_t in_stride,
                                                T* __restrict__ out, int64_t rows, int64_t inter,
                                                const DropoutArgs& d, int64_t i0) {
    for (int64_t n = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; n < rows;
         n += static_cast<int64_t>(gridDim.y) * blockDim.y) {
        const T* row = gate_up + n * in_stride;
        const Vec<T, V> gv = load_vec<T, V>(row + i0);
        const Vec<T, V> uv = load_vec<T, V>(row + inter + i0);
        bool keep[V];
        Vec<T, V> ov;
        if constexpr (STOCK) {
            // h = rnd(rnd(silu(g)) * u) held in T, then the dropout; drawing the mask after the products keeps
            // the vector kernels at the once loop's 32 registers on sm_90 (37-38 with the mask drawn first)
#pragma unroll
            for (int j = 0; j < V; ++j) {
                ov.val[j] = static_cast<T>(lf_round_to<T>(siluf_fast(static_cast<float>(gv.val[j]))) *
                                           static_cast<float>(uv.val[j]));
            }
            if constexpr (DROPOUT) {
                keep_bits<V>(d, static_cast<uint64_t>(n * inter + i0), keep);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    ov.val[j] = static_cast<T>(keep[j] ? static_cast<float>(ov.val[j]) * d.scale : 0.f);
                }
            }
        } else {
            if constexpr (DROPOUT) keep_bits<V>(d, static_cast<uint64_t>(n * inter + i0), keep);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float g = static_cast<float>(gv.val[j]);
                float o = g * sigmoidf_fast(g) * static_cast<float>(uv.val[j]);
                if constexpr (DROPOUT) o = keep[j] ? o * d.scale : 0.f;
                ov.val[j] = static_cast<T>(o);
            }
        }
        store_vec<T, V>(out + n * inter + i0, ov);
    }
}

template <typename T, int V, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(const T* __restrict__ gate_up, int64_t in_stride, T* __restrict__ out,
                      int64_t rows, int64_t inter, DropoutArgs d, bool stock_rounding) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= inter / V) return;
    if constexpr (kRoundsIntermediates<T>) {
        if (stock_rounding) {
            swiglu_fwd_rows<T, V, DROPOUT, true>(gate_up, in_stride, out, rows, inter, d, c * V);
            return;
        }
    }
    swiglu_fwd_rows<T, V, DROPOUT, false>(gate_up, in_stride, out, rows, inter, d, c * V);
}

// The backward's row loop of one rounding (see swiglu_fwd_rows).
template <typename T, int V, bool DROPOUT, bool STOCK>
__device__ __forceinline__ void swiglu_bwd_rows(const T* __restrict__ dout, const T* __restrict__ gate_up,
                                                int64_t in_stride, T* __restrict__ dgate_up, int64_t rows,
                                                int64_t inter, const DropoutArgs& d, int64_t i0) {
    for (int64_t n = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; n < rows;
         n += static_cast<int64_t>(gridDim.y) * blockDim.y) {
        const T* row = gate_up + n * in_stride;
        const Vec<T, V> gv = load_vec<T, V>(row + i0);
        const Vec<T, V> uv = load_vec<T, V>(row + inter + i0);
        const Vec<T, V> dv = load_vec<T, V>(dout + n * inter + i0);
        bool keep[V];
        if constexpr (DROPOUT) keep_bits<V>(d, static_cast<uint64_t>(n * inter + i0), keep);
        Vec<T, V> dgv, duv;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float g = static_cast<float>(gv.val[j]);
            const float u = static_cast<float>(uv.val[j]);
            if constexpr (STOCK) {
                float dh = static_cast<float>(dv.val[j]);
                if constexpr (DROPOUT) dh = keep[j] ? lf_round_to<T>(dh * d.scale) : 0.f;
                const float s = sigmoidf_fast(g);
                dgv.val[j] = static_cast<T>(lf_round_to<T>(dh * u) * s * (1.f + g * (1.f - s)));
                duv.val[j] = static_cast<T>(dh * lf_round_to<T>(siluf_fast(g)));
            } else {
                float dz = static_cast<float>(dv.val[j]);
                if constexpr (DROPOUT) dz = keep[j] ? dz * d.scale : 0.f;
                const float s = sigmoidf_fast(g);
                dgv.val[j] = static_cast<T>(dz * u * s * (1.f + g * (1.f - s)));
                duv.val[j] = static_cast<T>(dz * g * s);
            }
        }
        T* drow = dgate_up + n * 2 * inter;
        store_vec<T, V>(drow + i0, dgv);
        store_vec<T, V>(drow + inter + i0, duv);
    }
}

template <typename T, int V, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ gate_up, int64_t in_stride,
                      T* __restrict__ dgate_up, int64_t rows, int64_t inter, DropoutArgs d,
                      bool stock_rounding) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= inter / V) return;
    if constexpr (kRoundsIntermediates<T>) {
        if (stock_rounding) {
            swiglu_bwd_rows<T, V, DROPOUT, true>(dout, gate_up, in_stride, dgate_up, rows, inter, d, c * V);
            return;
        }
    }
    swiglu_bwd_rows<T, V, DROPOUT, false>(dout, gate_up, in_stride, dgate_up, rows, inter, d, c * V);
}

// p was checked to lie in [0, 1) by check_swiglu_*_args.
DropoutArgs make_dropout_args(double p, int64_t seed, int64_t offset) {
    return DropoutArgs{static_cast<uint64_t>(seed), static_cast<uint64_t>(offset),
                       keep_threshold_from_p(p), static_cast<float>(1.0 / (1.0 - p))};
}

// Grid over (vector within a row, row): x covers a row's vectors, y its rows. No grid-stride loop over
// a flat index: measured on an H200, the flat version's per-element 64-bit divide and loop held the
// backward at 44% of copy bandwidth, this layout at ~100%. Narrow rows share a block (blockDim.y > 1).
struct Launch {
    dim3 grid, block;
};

Launch launch_for(int64_t rows, int64_t vecs_per_row) {
    int tx = 1;
    while (tx < vecs_per_row && tx < kThreads) tx <<= 1;
    const int ty = kThreads / tx;
    const int64_t gy = std::min<int64_t>((rows + ty - 1) / ty, 65535);
    return {dim3(static_cast<unsigned>((vecs_per_row + tx - 1) / tx), static_cast<unsigned>(gy)), dim3(tx, ty)};
}

}  // namespace

}  // namespace loongforge
