// MoE dispatch row kernels on CUDA. Legend: T tokens, K experts per token, P = T*K pairs in expert-major
// order, H hidden; slot_TK[t, j] is the expert-major row of pair (t, j).
//
//   scatter (permute forward, unpermute backward):
//       dst_PH[slot[t, j]] = w[t, j] * src_TH[t]                     (w = 1: an exact copy)
//       dweights_TK[t, j]  = sum_h src_TH[t, h] * y_PH[slot[t, j], h] (unpermute backward, fp32)
//   gather (permute backward, unpermute forward):
//       dst_TH[t] = r[t] + sum_j w[t, j] * src_PH[slot[t, j]]        (fp32 in registers, one rounding;
//                                                                      r: the residual, 0 without one)
//       kStock: rnd(r[t] + rnd(sum_j w[t, j] * src_PH[slot[t, j]]))   (transformers' combine, then its decoder
//              layer's residual add; every product and sum rounded to fp32 on its own, no FMA, as torch's
//              separate mul and sum kernels round them)
//       kStockProducts: as kStock with each product rounded to T before it is summed (weights in T: torch's
//              16-bit multiply rounds them so)
//
// Both walk tokens: each token row is read once (permute forward writes its K copies instead of
// gathering P rows, which would read every x row K times), every P row is written exactly once (slot is
// a permutation) and every sum runs j = 0..K-1 in order, so there are no atomics and results are
// deterministic. The reads and writes are each row's bytes once: the kernels are bandwidth-bound.
// Layout: block = (tpr threads along a row) x (rows_per_block tokens); a thread walks its row in steps of
// tpr vectors of V elements, so no index is divided. With dweights a row gets at most one warp, so its
// K dot products reduce by shuffles alone: with a block per row, 2 barriers per pair held the backward at
// about half of copy bandwidth on an H200. Preconditions of the vector path (V = 16 / sizeof(T)):
// H % V == 0 and every row start 16-byte aligned (base pointers and row strides); otherwise V = 1.
// slot is not range-checked on the device (that would cost a host sync): it must come from
// routing_indices(); the CPU build checks it.
#include "lf_cuda_utils.cuh"
#include "moe_dispatch_checks.h"

namespace loongforge {
namespace {

constexpr int kThreads = 256;
// Pairs of a token the scatter handles per pass over its row: the row is loaded once per kPairChunk pairs
// (once in all for K <= 8) while the chunk's slots, weights and dot products stay in registers.
constexpr int kPairChunk = 8;
// The unpermute backward reads the y rows of this many pairs before it uses the first. One at a time (a
// load, its dot product, the next load) left each warp with one 512-byte read in flight, and the backward ran
// at ~65% of copy bandwidth on the H200 (1.63 ms per finegrained e2e step). More pairs hold more registers:
// benchmarks/diagnose_dispatch.py times the choices (it builds this file with the macro set).
#ifndef LF_DISPATCH_LOADS_IN_FLIGHT
#define LF_DISPATCH_LOADS_IN_FLIGHT 4
#endif
constexpr int kLoadsInFlight = LF_DISPATCH_LOADS_IN_FLIGHT;
static_assert(kLoadsInFlight >= 1 && kPairChunk % kLoadsInFlight == 0, "loads in flight must divide kPairChunk");

template <typename T, int V, bool WEIGHTED, bool DWEIGHTS>
__global__ void __launch_bounds__(kThreads)
    moe_scatter_rows_kernel(const T* __restrict__ src, int64_t src_stride, const int64_t* __restrict__ slot,
                            const float* __restrict__ weights, T* __restrict__ dst, const T* __restrict__ y,
                            int64_t y_stride, float* __restrict__ dweights, int64_t tokens, int k, int n_vec) {
    const int64_t hidden = static_cast<int64_t>(n_vec) * V;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < tokens;
         base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
        const int64_t t = base + threadIdx.y;
        const bool valid = t < tokens;
        const T* src_row = src + t * src_stride;
        for (int j0 = 0; j0 < k; j0 += kPairChunk) {
            const int nj = min(kPairChunk, k - j0);  // the same for every thread of the block
            int64_t row[kPairChunk];
            float w[kPairChunk];
            float dot[kPairChunk];
#pragma unroll
            for (int i = 0; i < kPairChunk; ++i) {
                const bool has = valid && i < nj;
                row[i] = has ? slot[t * k + j0 + i] : 0;
                w[i] = (WEIGHTED && has) ? weights[t * k + j0 + i] : 1.f;
                dot[i] = 0.f;
            }
            if (valid) {
                for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
                    const Vec<T, V> sv = load_vec<T, V>(src_row + c * V);
                    constexpr int kStep = DWEIGHTS ? kLoadsInFlight : 1;  // no reads without dweights
#pragma unroll
                    for (int i0 = 0; i0 < kPairChunk; i0 += kStep) {
                        // the y rows of kLoadsInFlight pairs are read before the first is used (predicated, no
                        // early exit between them)
                        Vec<T, V> yv[kStep];
                        if constexpr (DWEIGHTS) {
#pragma unroll
                            for (int d = 0; d < kStep; ++d) {
                                if (i0 + d < nj) yv[d] = load_vec<T, V>(y + row[i0 + d] * y_stride + c * V);
                            }
                        }
#pragma unroll
                        for (int d = 0; d < kStep; ++d) {
                            const int i = i0 + d;
                            if (i < nj) {
                                if constexpr (WEIGHTED) {
                                    Vec<T, V> ov;
#pragma unroll
                                    for (int e = 0; e < V; ++e) ov.val[e] = static_cast<T>(w[i] * static_cast<float>(sv.val[e]));
                                    store_vec<T, V>(dst + row[i] * hidden + c * V, ov);
                                } else {
                                    store_vec<T, V>(dst + row[i] * hidden + c * V, sv);
                                }
                                if constexpr (DWEIGHTS) {
#pragma unroll
                                    for (int e = 0; e < V; ++e) {
                                        dot[i] = fmaf(static_cast<float>(sv.val[e]), static_cast<float>(yv[d].val[e]), dot[i]);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            if constexpr (DWEIGHTS) {
#pragma unroll
                for (int i = 0; i < kPairChunk; ++i) {
                    if (i >= nj) break;  // uniform over the block: every lane takes part in the shuffles
                    // tpr <= 32 (plan_token_launch): a shuffle reduction that never touches shared memory
                    const float d = row_allreduce_sum(dot[i], nullptr, blockDim.x);
                    if (valid && threadIdx.x == 0) dweights[t * k + j0 + i] = d;
                }
            }
        }
    }
}

// The gather's roundings (ops/moe_dispatch.py: moe_unpermute's rounding): kOnce, one rounding of r + sum; kStock
// and kStockProducts as in the header.
constexpr int kOnce = 0, kStock = 1, kStockProducts = 2;

// A gather's fp32 sum of one vector: started from the residual row (RESIDUAL, kOnce) or 0, rounded once at the
// store; otherwise the residual is added at the store, to the rounded sum, and rounded again.
template <typename T, int V, bool RESIDUAL>
__device__ __forceinline__ Vec<T, V> load_residual(const T* residual, int64_t offset) {
    Vec<T, V> rv;
    if constexpr (RESIDUAL) rv = load_vec<T, V>(residual + offset);  // no arithmetic on the null pointer otherwise
    return rv;
}

template <typename T, int V, bool RESIDUAL, int MODE>
__device__ __forceinline__ void start_sum(float (&acc)[V], const Vec<T, V>& rv) {
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = (RESIDUAL && MODE == kOnce) ? static_cast<float>(rv.val[e]) : 0.f;
}

template <typename T, int MODE>
__device__ __forceinline__ float add_product(float acc, float w, float v) {
    if constexpr (MODE == kOnce) {
        return fmaf(w, v, acc);
    } else if constexpr (MODE == kStock) {
        return __fadd_rn(acc, __fmul_rn(w, v));  // never contracted into an FMA
    } else {
        return __fadd_rn(acc, lf_round_to<T>(__fmul_rn(w, v)));
    }
}

template <typename T, int V, bool RESIDUAL, int MODE>
__device__ __forceinline__ void store_sum(T* dst_vec, const float (&acc)[V], const Vec<T, V>& rv) {
    Vec<T, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e) {
        if constexpr (RESIDUAL && MODE != kOnce) {
            out.val[e] = static_cast<T>(__fadd_rn(static_cast<float>(rv.val[e]), lf_round_to<T>(acc[e])));
        } else {
            out.val[e] = static_cast<T>(acc[e]);
        }
    }
    store_vec<T, V>(dst_vec, out);
}

// The gather reads the rows of kLoadsInFlight pairs of a token before it adds the first, so that a thread has
// that many 16-byte reads in flight instead of one dependent load at a time; the sum runs j = 0..K-1 in order in
// fp32 registers, after the residual when there is one, and is rounded once (kStock, kStockProducts: from 0,
// rounded, then the residual added and rounded again).
template <typename T, int V, bool WEIGHTED, bool RESIDUAL, int MODE>
__global__ void __launch_bounds__(kThreads)
    moe_gather_rows_kernel(const T* __restrict__ src, int64_t src_stride, const int64_t* __restrict__ slot,
                           const float* __restrict__ weights, const T* __restrict__ residual, int64_t res_stride,
                           T* __restrict__ dst, int64_t tokens, int k, int n_vec) {
    const int64_t hidden = static_cast<int64_t>(n_vec) * V;
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; t < tokens;
         t += static_cast<int64_t>(gridDim.x) * blockDim.y) {
        const int64_t* slot_t = slot + t * k;
        for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
            float acc[V];
            const Vec<T, V> rv = load_residual<T, V, RESIDUAL>(residual, t * res_stride + c * V);
            start_sum<T, V, RESIDUAL, MODE>(acc, rv);
            for (int j0 = 0; j0 < k; j0 += kLoadsInFlight) {
                Vec<T, V> v[kLoadsInFlight];
                float w[kLoadsInFlight];
#pragma unroll
                for (int d = 0; d < kLoadsInFlight; ++d) {
                    if (j0 + d < k) {
                        v[d] = load_vec<T, V>(src + slot_t[j0 + d] * src_stride + c * V);
                        w[d] = WEIGHTED ? weights[t * k + j0 + d] : 1.f;
                    }
                }
#pragma unroll
                for (int d = 0; d < kLoadsInFlight; ++d) {
                    if (j0 + d < k) {
#pragma unroll
                        for (int e = 0; e < V; ++e) {
                            acc[e] = add_product<T, MODE>(acc[e], w[d], static_cast<float>(v[d].val[e]));
                        }
                    }
                }
            }
            store_sum<T, V, RESIDUAL, MODE>(dst + t * hidden + c * V, acc, rv);
        }
    }
}

// The gather with the next token's slots and weights in flight while a token's rows are read (K <= KMAX): a
// persistent grid whose threads walk tokens, every row of a token and the residual read at once. In the
// one-token-a-thread gather above, a thread's row reads wait for its slot reads (an L2 round trip) and it ends
// after one token. The same sums in the same order: the same bits. Where it is used, and where the H200 measured
// it slower, is in moe_gather_rows_cuda; LF_GATHER_PIPELINED=0 builds use the kernel above everywhere
// (benchmarks/diagnose_dispatch.py times both).
#ifndef LF_GATHER_PIPELINED
#define LF_GATHER_PIPELINED 1
#endif
template <typename T, int V, bool WEIGHTED, bool RESIDUAL, int MODE, int KMAX>
__global__ void __launch_bounds__(kThreads)
    moe_gather_rows_pipelined_kernel(const T* __restrict__ src, int64_t src_stride, const int64_t* __restrict__ slot,
                                     const float* __restrict__ weights, const T* __restrict__ residual,
                                     int64_t res_stride, T* __restrict__ dst, int64_t tokens, int k, int n_vec) {
    const int64_t hidden = static_cast<int64_t>(n_vec) * V;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
    int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
    int64_t next_row[KMAX];
    float next_w[KMAX];
#pragma unroll
    for (int j = 0; j < KMAX; ++j) {
        const bool has = t < tokens && j < k;
        next_row[j] = has ? slot[t * k + j] : 0;
        next_w[j] = (WEIGHTED && has) ? weights[t * k + j] : 1.f;
    }
    for (; t < tokens; t += stride) {
        int64_t row[KMAX];
        float w[KMAX];
#pragma unroll
        for (int j = 0; j < KMAX; ++j) {
            row[j] = next_row[j];
            w[j] = next_w[j];
        }
        const int64_t tn = t + stride;
#pragma unroll
        for (int j = 0; j < KMAX; ++j) {  // the next token's indices: read while this token's rows arrive
            const bool has = tn < tokens && j < k;
            next_row[j] = has ? slot[tn * k + j] : 0;
            next_w[j] = (WEIGHTED && has) ? weights[tn * k + j] : 1.f;
        }
        for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
            Vec<T, V> v[KMAX];
#pragma unroll
            for (int j = 0; j < KMAX; ++j) {
                if (j < k) v[j] = load_vec<T, V>(src + row[j] * src_stride + c * V);
            }
            float acc[V];
            const Vec<T, V> rv = load_residual<T, V, RESIDUAL>(residual, t * res_stride + c * V);
            start_sum<T, V, RESIDUAL, MODE>(acc, rv);
#pragma unroll
            for (int j = 0; j < KMAX; ++j) {
                if (j < k) {
#pragma unroll
                    for (int e = 0; e < V; ++e) {
                        acc[e] = add_product<T, MODE>(acc[e], w[j], static_cast<float>(v[j].val[e]));
                    }
                }
            }
            store_sum<T, V, RESIDUAL, MODE>(dst + t * hidden + c * V, acc, rv);
        }
    }
}

struct TokenLaunch {
    dim3 grid, block;
};

// Threads per row: the row's vectors rounded up to a power of two below a warp, to whole warps above,
// at most max_tpr (a block, or a warp when the kernel reduces along the row); narrow rows share a block.
// The grid covers every token once up to 64 blocks per SM; beyond that the kernels loop.
TokenLaunch plan_token_launch(int64_t tokens, int n_vec, int max_tpr = kThreads) {
    int tpr = 1;
    while (tpr < n_vec && tpr < 32) tpr <<= 1;
    if (n_vec > 32) tpr = std::min(max_tpr, (n_vec + 31) / 32 * 32);
    const int rows_per_block = kThreads / tpr;
    const int64_t max_blocks = static_cast<int64_t>(lf_sm_count()) * 64;
    const int64_t blocks = std::min(max_blocks, (tokens + rows_per_block - 1) / rows_per_block);
    return {dim3(static_cast<unsigned>(blocks)), dim3(tpr, rows_per_block)};
}

bool rows_aligned16(const at::Tensor& rows) {
    return lf_aligned16(rows.data_ptr()) && (rows.stride(0) * rows.element_size()) % 16 == 0;
}

// Run fn.template operator()<V>() with 16-byte vectors when H and the rows allow them, else V = 1.
template <typename T>
void dispatch_vec(int64_t hidden, bool rows_aligned, const auto& fn) {
    constexpr int kVec = 16 / sizeof(T);
    if (rows_aligned && hidden % kVec == 0) fn.template operator()<kVec>();
    else fn.template operator()<1>();
}

}  // namespace

void moe_scatter_rows_cuda(const at::Tensor& src_TH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                           const at::Tensor& dst_PH, const at::Tensor& y_PH, const at::Tensor& dweights_TK) {
    const int64_t tokens = slot_TK.size(0);
    const int k = static_cast<int>(slot_TK.size(1));
    const int64_t hidden = src_TH.size(1);
    const bool weighted = weights_TK.defined();
    const bool need_dweights = y_PH.defined();
    const c10::cuda::CUDAGuard guard(src_TH.device());
    if (tokens == 0 || k == 0) return;
    if (hidden == 0) {
        if (need_dweights) dweights_TK.zero_();
        return;
    }
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(src_TH.scalar_type(), "moe_scatter_rows", [&] {
        using T = scalar_t;
        const T* y = need_dweights ? y_PH.data_ptr<T>() : nullptr;
        const int64_t y_stride = need_dweights ? y_PH.stride(0) : 0;
        float* dweights = need_dweights ? dweights_TK.data_ptr<float>() : nullptr;
        const float* weights = weighted ? weights_TK.data_ptr<float>() : nullptr;
        const bool aligned =
            rows_aligned16(src_TH) && rows_aligned16(dst_PH) && (!need_dweights || rows_aligned16(y_PH));
        dispatch_vec<T>(hidden, aligned, [&]<int V>() {
            const int n_vec = static_cast<int>(hidden / V);
            const TokenLaunch l = plan_token_launch(tokens, n_vec, need_dweights ? 32 : kThreads);
            auto launch = [&]<bool WEIGHTED, bool DWEIGHTS>() {
                moe_scatter_rows_kernel<T, V, WEIGHTED, DWEIGHTS><<<l.grid, l.block, 0, stream>>>(
                    src_TH.data_ptr<T>(), src_TH.stride(0), slot_TK.data_ptr<int64_t>(), weights,
                    dst_PH.data_ptr<T>(), y, y_stride, dweights, tokens, k, n_vec);
            };
            // the combinations the ops use: permute forward (copy), unpermute backward with or without dweights
            if (!weighted) launch.template operator()<false, false>();
            else if (need_dweights) launch.template operator()<true, true>();
            else launch.template operator()<true, false>();
            LF_CUDA_CHECK_LAUNCH();
        });
    });
}

void moe_gather_rows_cuda(const at::Tensor& src_PH, const at::Tensor& slot_TK, const at::Tensor& weights_TK,
                          const at::Tensor& residual_TH, const at::Tensor& dst_TH, bool stock,
                          bool round_products) {
    const int64_t tokens = slot_TK.size(0);
    const int k = static_cast<int>(slot_TK.size(1));
    const int64_t hidden = src_PH.size(1);
    const bool weighted = weights_TK.defined();
    const bool has_residual = residual_TH.defined();
    const c10::cuda::CUDAGuard guard(src_PH.device());
    if (tokens == 0 || hidden == 0) return;
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(src_PH.scalar_type(), "moe_gather_rows", [&] {
        using T = scalar_t;
        const float* weights = weighted ? weights_TK.data_ptr<float>() : nullptr;
        const T* residual = has_residual ? residual_TH.data_ptr<T>() : nullptr;
        const int64_t res_stride = has_residual ? residual_TH.stride(0) : 0;
        const bool aligned =
            rows_aligned16(src_PH) && rows_aligned16(dst_TH) && (!has_residual || rows_aligned16(residual_TH));
        dispatch_vec<T>(hidden, aligned, [&]<int V>() {
            const int n_vec = static_cast<int>(hidden / V);
            const TokenLaunch l = plan_token_launch(tokens, n_vec);
            auto launch = [&]<bool WEIGHTED, bool RESIDUAL, int MODE>() {
                auto pipelined = [&]<int KMAX>() {  // a persistent grid: the resident blocks, each walking tokens
                    auto kernel = moe_gather_rows_pipelined_kernel<T, V, WEIGHTED, RESIDUAL, MODE, KMAX>;
                    const int64_t resident =
                        static_cast<int64_t>(lf_sm_count()) * std::max(1, lf_max_blocks_per_sm(kernel, kThreads));
                    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(l.grid.x, resident)));
                    kernel<<<grid, l.block, 0, stream>>>(src_PH.data_ptr<T>(), src_PH.stride(0),
                                                         slot_TK.data_ptr<int64_t>(), weights, residual, res_stride,
                                                         dst_TH.data_ptr<T>(), tokens, k, n_vec);
                };
                // measured on the H200 (diagnose_dispatch_401c695): the pipelined gather wins only with the
                // residual at K <= 2 (mixtral e2e: 42.2 against 57.7 us); without the residual it lost (55.5 against
                // 39.7 us), and at K = 8 with the residual too (103.5 against 95.8 us). K = 3..4 is unmeasured.
                if constexpr (RESIDUAL && LF_GATHER_PIPELINED) {
                    if (k <= 2) return pipelined.template operator()<2>();
                }
                moe_gather_rows_kernel<T, V, WEIGHTED, RESIDUAL, MODE><<<l.grid, l.block, 0, stream>>>(
                    src_PH.data_ptr<T>(), src_PH.stride(0), slot_TK.data_ptr<int64_t>(), weights, residual,
                    res_stride, dst_TH.data_ptr<T>(), tokens, k, n_vec);
            };
            // the combinations the ops use: permute backward (a plain sum), unpermute forward with or without
            // the residual, in each rounding (lf_round_to: rounding a float product to float changes nothing)
            const int mode = !stock ? kOnce : round_products ? kStockProducts : kStock;
            auto modes = [&]<bool RESIDUAL>() {
                if (mode == kOnce) launch.template operator()<true, RESIDUAL, kOnce>();
                else if (mode == kStock) launch.template operator()<true, RESIDUAL, kStock>();
                else launch.template operator()<true, RESIDUAL, kStockProducts>();
            };
            if (!weighted) launch.template operator()<false, false, kOnce>();
            else if (has_residual) modes.template operator()<true>();
            else modes.template operator()<false>();
            LF_CUDA_CHECK_LAUNCH();
        });
    });
}

}  // namespace loongforge
