// Fused RMSNorm (optionally with the residual add in front) on CUDA.
//
//   h = x + residual (rounded to the activation dtype, as an unfused add would store it)
//   y = h * rstd * w,  rstd = 1 / sqrt(mean(h^2) + eps)            (fp32 arithmetic, one rounding)
//   backward: xhat = h * rstd, g = w * dy
//             dx = rstd * (g - xhat * mean(xhat * g)) [+ d(h_out)],  dw = sum_rows(dy * xhat)
//
// That is the "once" rounding. With `stock` (the default of the op) the kernels round where transformers'
// eager RMSNorm does, `weight * (h * rstd).to(dtype)`, and where its autograd stores intermediates:
//   y = rnd(rnd(xhat) * w);  g = rnd(w * dy) (autograd stores the gradient of the rounded xhat in its dtype);
//   dw = sum_rows(rnd(dy * rnd(xhat))) when w has h's dtype (a 16-bit product), sum_rows(dy * rnd(xhat)) when w
//   is float32; rnd = lf_round_to<T>, the identity for float32 activations. The flag is a kernel argument (a
// uniform branch), not a template parameter, so the JIT build compiles no more kernels; except in the register
// path's backward (see there).
//
// Layout: rows of `hidden` elements; inputs may have a row stride, elements in a row are adjacent.
// Preconditions of the register path: hidden % V == 0, every row start 16-byte aligned; each thread
// keeps VPT vectors of its row in registers, so the row is read from memory once per pass. Otherwise
// (odd or very large hidden sizes) the streaming path re-reads the row, which stays in L1/L2.
// dw is reduced deterministically: per-(block,row-slot) fp32 partials, then a column reduction.
// Kernels and launch helpers shared by the forward and backward translation units (compiled in
// parallel by ninja, which keeps the cold JIT build short).
#pragma once

#include "lf_cuda_utils.cuh"
#include "rmsnorm_checks.h"

namespace loongforge {
namespace {

constexpr int kRowsSmem = 8 * 32;  // 32 floats per row slot; row slots per block <= 8 when tpr >= 32

// The two roundings as selects on one expression (no second copy of the loop body, which cost the 64-register
// backward kernels their spill-free code): xhat as the forward stores it, the input gradient w * dy as autograd
// stores the gradient of that xhat, and dw's term dy * xhat, stored in T by autograd when w is T. The register
// path's kernels round the same values two at a time instead (lf_round_pair: one packed conversion, where sm_90
// runs scalar ones at a quarter rate), its backward with the rounding as a template parameter.
template <typename T>
__device__ __forceinline__ float normed(float xhat, bool stock) {
    return stock ? lf_round_to<T>(xhat) : xhat;
}

template <typename T>
__device__ __forceinline__ float grad_in(float wdy, bool stock) {
    return stock ? lf_round_to<T>(wdy) : wdy;
}

template <typename T, typename W>
__device__ __forceinline__ float dw_term(float dy, float xhat, bool stock) {
    const float p = dy * normed<T>(xhat, stock);
    return stock && std::is_same_v<T, W> ? lf_round_to<T>(p) : p;
}

template <int VPT>
constexpr int max_threads_for_vpt() {
    return VPT <= 2 ? 1024 : 512;
}

template <typename T, typename W, int V, int VPT, bool RES>
__global__ void __launch_bounds__(max_threads_for_vpt<VPT>())
    rmsnorm_fwd_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ res,
                       int64_t res_stride, const W* __restrict__ w, T* __restrict__ y,
                       T* __restrict__ h_out, float* __restrict__ rstd_out, int64_t rows, int hidden,
                       float eps, bool stock) {
    static_assert(V % 2 == 0, "y rounds pairs of elements");
    __shared__ float smem[kRowsSmem];
    const int tpr = blockDim.x;
    const int n_vec = hidden / V;
    const float inv_hidden = 1.f / static_cast<float>(hidden);
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows;
         base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
        const int64_t row = base + threadIdx.y;
        const bool valid = row < rows;
        Vec<T, V> hv[VPT];  // the row in its own dtype: half the registers of fp32 copies
        float sumsq = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = threadIdx.x + k * tpr;
            if (valid && c < n_vec) {
                hv[k] = load_vec<T, V>(x + row * x_stride + c * V);
                if constexpr (RES) {
                    const Vec<T, V> rv = load_vec<T, V>(res + row * res_stride + c * V);
#pragma unroll
                    for (int j = 0; j < V; j += 2) {  // h = rnd(x + residual), two values a conversion
                        float a = static_cast<float>(hv[k].val[j]) + static_cast<float>(rv.val[j]);
                        float b = static_cast<float>(hv[k].val[j + 1]) + static_cast<float>(rv.val[j + 1]);
                        lf_round_pair<T>(a, b, &hv[k].val[j]);
                    }
                    store_vec<T, V>(h_out + row * hidden + c * V, hv[k]);
                }
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float v = static_cast<float>(hv[k].val[j]);
                    sumsq += v * v;
                }
            }
        }
        sumsq = row_allreduce_sum(sumsq, smem, tpr);
        const float rstd = rsqrtf(sumsq * inv_hidden + eps);
        if (valid && threadIdx.x == 0) rstd_out[row] = rstd;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = threadIdx.x + k * tpr;
            if (valid && c < n_vec) {
                const Vec<W, V> wv = load_vec<W, V>(w + c * V);
                Vec<T, V> yv;
#pragma unroll
                for (int j = 0; j < V; j += 2) {  // normed's rounding, two values a conversion
                    float n0 = static_cast<float>(hv[k].val[j]) * rstd;
                    float n1 = static_cast<float>(hv[k].val[j + 1]) * rstd;
                    if (stock) lf_round_pair<T>(n0, n1);
                    yv.val[j] = static_cast<T>(n0 * static_cast<float>(wv.val[j]));
                    yv.val[j + 1] = static_cast<T>(n1 * static_cast<float>(wv.val[j + 1]));
                }
                store_vec<T, V>(y + row * hidden + c * V, yv);
            }
        }
    }
}

// STOCK is a template parameter here, unlike in the other kernels: as a runtime select it raised the spills of the
// 64-register (VPT = 2) instances from 2-16 to 20-48 bytes.
template <typename T, typename W, int V, int VPT, bool DRES, bool STOCK>
__global__ void __launch_bounds__(max_threads_for_vpt<VPT>())
    rmsnorm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ h, int64_t h_stride,
                       const float* __restrict__ rstd_in, const W* __restrict__ w,
                       const T* __restrict__ dres, T* __restrict__ dx,
                       float* __restrict__ dw_partial, int64_t rows, int hidden) {
    constexpr bool stock = STOCK;
    // One vector a thread (VPT = 1): the residual's gradient is read with the row, before the row's reduction,
    // not after it: a second wait on DRAM per row held this latency-bound loop at 59% of copy on the H200 (ncu,
    // e2e mixtral shape, bfcb015). With more vectors a thread the extra registers spill (12-16 -> 34-70 bytes).
    constexpr bool kEarlyDres = DRES && VPT == 1;
    static_assert(V % 2 == 0, "pass 1 rounds pairs of elements");
    __shared__ float smem[kRowsSmem];
    const int tpr = blockDim.x;
    const int n_vec = hidden / V;
    const float inv_hidden = 1.f / static_cast<float>(hidden);
    float acc[VPT][V];
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[k][j] = 0.f;

    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows;
         base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
        const int64_t row = base + threadIdx.y;
        const bool valid = row < rows;
        const float rstd = valid ? rstd_in[row] : 0.f;
        // raw 16-bit vectors; xhat is recomputed in pass 2, and w * dy too under "once" (under "stock" pass 1
        // leaves it in dv, rounded to T as autograd stores it)
        Vec<T, V> hv[VPT], dv[VPT], rv[VPT];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = threadIdx.x + k * tpr;
            if (valid && c < n_vec) {
                hv[k] = load_vec<T, V>(h + row * h_stride + c * V);
                dv[k] = load_vec<T, V>(dy + row * hidden + c * V);
                if constexpr (kEarlyDres) rv[k] = load_vec<T, V>(dres + row * hidden + c * V);
                const Vec<W, V> wv = load_vec<W, V>(w + c * V);
                if constexpr (stock) {
                    // the same roundings as dw_term / grad_in, two values a conversion; the rounded w * dy goes
                    // into dv in place of dy (pass 2 needs only it), so pass 2 converts nothing and reads no w
#pragma unroll
                    for (int j = 0; j < V; j += 2) {
                        const float d0 = static_cast<float>(dv[k].val[j]), d1 = static_cast<float>(dv[k].val[j + 1]);
                        const float x0 = static_cast<float>(hv[k].val[j]) * rstd;
                        const float x1 = static_cast<float>(hv[k].val[j + 1]) * rstd;
                        float g0 = d0 * static_cast<float>(wv.val[j]), g1 = d1 * static_cast<float>(wv.val[j + 1]);
                        lf_round_pair<T>(g0, g1, &dv[k].val[j]);
                        dot += x0 * g0;
                        dot += x1 * g1;
                        float n0 = x0, n1 = x1;
                        lf_round_pair<T>(n0, n1);
                        float p0 = d0 * n0, p1 = d1 * n1;
                        if constexpr (std::is_same_v<T, W>) lf_round_pair<T>(p0, p1);
                        acc[k][j] += p0;
                        acc[k][j + 1] += p1;
                    }
                } else {  // "once": no rounding
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                        const float d = static_cast<float>(dv[k].val[j]);
                        const float xhat = static_cast<float>(hv[k].val[j]) * rstd;
                        dot += xhat * (d * static_cast<float>(wv.val[j]));
                        acc[k][j] += d * xhat;
                    }
                }
            }
        }
        dot = row_allreduce_sum(dot, smem, tpr) * inv_hidden;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = threadIdx.x + k * tpr;
            if (valid && c < n_vec) {
                Vec<W, V> wv;
                if constexpr (!stock) wv = load_vec<W, V>(w + c * V);
                Vec<T, V> out;
                if constexpr (DRES && !kEarlyDres) rv[k] = load_vec<T, V>(dres + row * hidden + c * V);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float xhat = static_cast<float>(hv[k].val[j]) * rstd;
                    // stock: dv holds w * dy rounded to T (pass 1); once: dy, times w here in fp32
                    const float g = stock ? static_cast<float>(dv[k].val[j])
                                          : static_cast<float>(dv[k].val[j]) * static_cast<float>(wv.val[j]);
                    float v = rstd * (g - xhat * dot);
                    if constexpr (DRES) v += static_cast<float>(rv[k].val[j]);
                    out.val[j] = static_cast<T>(v);
                }
                store_vec<T, V>(dx + row * hidden + c * V, out);
            }
        }
    }
    float* my_partial =
        dw_partial + (static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y) * hidden;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int c = threadIdx.x + k * tpr;
        if (c < n_vec) {
            Vec<float, V> pv;
#pragma unroll
            for (int j = 0; j < V; ++j) pv.val[j] = acc[k][j];
            store_vec<float, V>(my_partial + c * V, pv);
        }
    }
}

// One row per block; two passes over the row from global memory (the second hits L1/L2).
template <typename T, typename W, int V, bool RES>
__global__ void __launch_bounds__(1024)
    rmsnorm_fwd_streaming_kernel(const T* __restrict__ x, int64_t x_stride,
                                 const T* __restrict__ res, int64_t res_stride,
                                 const W* __restrict__ w, T* __restrict__ y, T* __restrict__ h_out,
                                 float* __restrict__ rstd_out, int64_t rows, int hidden,
                                 float eps, bool stock) {
    __shared__ float smem[kRowsSmem];
    const int n_vec = hidden / V;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* src = RES ? h_out + row * hidden : x + row * x_stride;
        float sumsq = 0.f;
        for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
            Vec<T, V> xv = load_vec<T, V>(x + row * x_stride + c * V);
            if constexpr (RES) {
                const Vec<T, V> rv = load_vec<T, V>(res + row * res_stride + c * V);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    xv.val[j] = static_cast<T>(static_cast<float>(xv.val[j]) +
                                               static_cast<float>(rv.val[j]));
                }
                store_vec<T, V>(h_out + row * hidden + c * V, xv);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float v = static_cast<float>(xv.val[j]);
                sumsq += v * v;
            }
        }
        sumsq = row_allreduce_sum(sumsq, smem, blockDim.x);
        const float rstd = rsqrtf(sumsq / static_cast<float>(hidden) + eps);
        if (threadIdx.x == 0) rstd_out[row] = rstd;
        for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
            const Vec<T, V> hv = load_vec<T, V>(src + c * V);
            const Vec<W, V> wv = load_vec<W, V>(w + c * V);
            Vec<T, V> yv;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                yv.val[j] = static_cast<T>(normed<T>(static_cast<float>(hv.val[j]) * rstd, stock) *
                                           static_cast<float>(wv.val[j]));
            }
            store_vec<T, V>(y + row * hidden + c * V, yv);
        }
    }
}

// dw_partial must be zeroed: each block accumulates into its own partial row.
template <typename T, typename W, int V, bool DRES>
__global__ void __launch_bounds__(1024)
    rmsnorm_bwd_streaming_kernel(const T* __restrict__ dy, const T* __restrict__ h,
                                 int64_t h_stride, const float* __restrict__ rstd_in,
                                 const W* __restrict__ w, const T* __restrict__ dres,
                                 T* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows,
                                 int hidden, bool stock) {
    __shared__ float smem[kRowsSmem];
    const int n_vec = hidden / V;
    float* my_partial = dw_partial + static_cast<int64_t>(blockIdx.x) * hidden;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const float rstd = rstd_in[row];
        float dot = 0.f;
        for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
            const Vec<T, V> hv = load_vec<T, V>(h + row * h_stride + c * V);
            const Vec<T, V> dv = load_vec<T, V>(dy + row * hidden + c * V);
            const Vec<W, V> wv = load_vec<W, V>(w + c * V);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float d = static_cast<float>(dv.val[j]);
                dot += static_cast<float>(hv.val[j]) * rstd * grad_in<T>(d * static_cast<float>(wv.val[j]), stock);
            }
        }
        dot = row_allreduce_sum(dot, smem, blockDim.x) / static_cast<float>(hidden);
        for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
            const Vec<T, V> hv = load_vec<T, V>(h + row * h_stride + c * V);
            const Vec<T, V> dv = load_vec<T, V>(dy + row * hidden + c * V);
            const Vec<W, V> wv = load_vec<W, V>(w + c * V);
            Vec<T, V> out;
            Vec<float, V> pv = load_vec<float, V>(my_partial + c * V);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float xhat = static_cast<float>(hv.val[j]) * rstd;
                const float d = static_cast<float>(dv.val[j]);
                const float g = grad_in<T>(d * static_cast<float>(wv.val[j]), stock);
                float v = rstd * (g - xhat * dot);
                if constexpr (DRES) v += static_cast<float>(dres[row * hidden + c * V + j]);
                out.val[j] = static_cast<T>(v);
                pv.val[j] += dw_term<T, W>(d, xhat, stock);
            }
            store_vec<float, V>(my_partial + c * V, pv);
            store_vec<T, V>(dx + row * hidden + c * V, out);
        }
    }
}

// dw[c] = sum_g partial[g, c], in a fixed order.
template <typename W>
__global__ void __launch_bounds__(512) rmsnorm_dw_reduce_kernel(const float* __restrict__ partial,
                                                                 int64_t groups, int hidden,
                                                                 W* __restrict__ dw) {
    __shared__ float tile[16][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (col < hidden) {
        for (int64_t g = threadIdx.y; g < groups; g += 16) s += partial[g * hidden + col];
    }
    tile[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < hidden) {
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) total += tile[i][threadIdx.x];
        dw[col] = static_cast<W>(total);
    }
}

struct RowPlan {
    int vec;        // elements per access (1 when hidden or alignment rule out 16-byte access)
    int vpt;        // vectors per thread kept in registers; 0 selects the streaming kernels
    int tpr;        // threads per row
    int rows_per_block;
};

int next_pow2(int v) {
    int p = 1;
    while (p < v) p <<= 1;
    return p;
}

RowPlan plan_rows(int hidden, int elem_size, bool aligned) {
    const int full_vec = 16 / elem_size;
    RowPlan plan{1, 0, 0, 1};
    if (aligned && hidden % full_vec == 0) {
        plan.vec = full_vec;
        const int n_vec = hidden / full_vec;
        // (vectors per thread, most threads per row), first fit wins: few registers and several blocks
        // per SM first; 4 x 512 rather than 8 x 256 for the widest rows, since 8 vectors per thread need
        // ~240 registers in backward (one 256-thread block per SM) and 4 need 128.
        constexpr int kCandidates[4][2] = {{1, 256}, {2, 256}, {4, 256}, {4, 512}};
        for (const auto& cand : kCandidates) {
            const int threads = (n_vec + cand[0] - 1) / cand[0];
            if (threads <= cand[1]) {
                plan.vpt = cand[0];
                plan.tpr = threads < 32 ? next_pow2(threads) : (threads + 31) / 32 * 32;
                plan.rows_per_block = plan.tpr >= 256 ? 1 : 256 / plan.tpr;
                return plan;
            }
        }
    }
    const int n_vec = hidden / plan.vec;
    plan.tpr = std::min(1024, (n_vec + 31) / 32 * 32);
    return plan;
}

template <int V>
void dispatch_vpt(int vpt, const auto& fn) {
    switch (vpt) {
        case 1: fn.template operator()<V, 1>(); break;
        case 2: fn.template operator()<V, 2>(); break;
        case 4: fn.template operator()<V, 4>(); break;
        default: LF_CHECK(false, "rmsnorm: internal error, unexpected vectors per thread ", vpt);
    }
}

}  // namespace

}  // namespace loongforge
