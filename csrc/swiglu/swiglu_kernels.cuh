// Fused SwiGLU + dropout on the concatenated gate/up projection, on CUDA.
//
//   gate_up[n, :] = [gate (I) | up (I)]          (one GEMM with weight [2I, H] produced it)
//   out[n, i]     = silu(gate) * up * keep(e) / (1 - p),   e = n * I + i
//   keep(e)       = Philox4x32-10(counter = (e / 4, offset), key = seed)[e % 4] < (1 - p) * 2^32
//   backward:     dz = dout * keep / (1 - p);  s = sigmoid(gate)
//                 dgate = dz * up * s * (1 + gate * (1 - s)),  dup = dz * gate * s
//
// The mask is never stored: backward regenerates it from (seed, offset). With p == 0 the kernels are
// instantiated without any RNG. Arithmetic is fp32 with one rounding per output.
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

template <typename T, int V, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(const T* __restrict__ gate_up, int64_t in_stride, T* __restrict__ out,
                      int64_t rows, int64_t inter, DropoutArgs d) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= inter / V) return;
    const int64_t i0 = c * V;
    for (int64_t n = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; n < rows;
         n += static_cast<int64_t>(gridDim.y) * blockDim.y) {
        const T* row = gate_up + n * in_stride;
        const Vec<T, V> gv = load_vec<T, V>(row + i0);
        const Vec<T, V> uv = load_vec<T, V>(row + inter + i0);
        bool keep[V];
        if constexpr (DROPOUT) keep_bits<V>(d, static_cast<uint64_t>(n * inter + i0), keep);
        Vec<T, V> ov;
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float g = static_cast<float>(gv.val[j]);
            float o = g * sigmoidf_fast(g) * static_cast<float>(uv.val[j]);
            if constexpr (DROPOUT) o = keep[j] ? o * d.scale : 0.f;
            ov.val[j] = static_cast<T>(o);
        }
        store_vec<T, V>(out + n * inter + i0, ov);
    }
}

template <typename T, int V, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(const T* __restrict__ dout, const T* __restrict__ gate_up, int64_t in_stride,
                      T* __restrict__ dgate_up, int64_t rows, int64_t inter, DropoutArgs d) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= inter / V) return;
    const int64_t i0 = c * V;
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
            float dz = static_cast<float>(dv.val[j]);
            if constexpr (DROPOUT) dz = keep[j] ? dz * d.scale : 0.f;
            const float s = sigmoidf_fast(g);
            dgv.val[j] = static_cast<T>(dz * u * s * (1.f + g * (1.f - s)));
            duv.val[j] = static_cast<T>(dz * g * s);
        }
        T* drow = dgate_up + n * 2 * inter;
        store_vec<T, V>(drow + i0, dgv);
        store_vec<T, V>(drow + inter + i0, duv);
    }
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
