// MoE router top-k on CUDA: softmax (fp32) -> the k best experts -> optional renormalisation, forward and
// backward, one warp per token. Legend: T tokens, E experts, K experts per token.
//
//   forward:  p_TE = softmax(float(logits_TE)); ids_TK = the K largest p (descending, the lowest expert first
//             among equal values, NaN above every number, as torch.topk orders NaN); w_TK = p[ids], divided by
//             their sum when renormalising
//   backward: g_K = renormalise ? (dw_K - sum_j dw_j w_j) / s : dw_K      (s = sum_j p[ids_j])
//             dp_E = dprobs_E (0 when undefined) + sum_j [e == ids_j] g_j
//             dlogits_E = p_E * (dp_E - sum_e p_e dp_e)                    (fp32, one rounding)
//
// The unfused router (softmax, topk, sum, div; and in backward the div's and topk's gradients, the softmax
// backward and the cast) is about a dozen kernels per layer on [T, E] tensors of a few hundred KiB: launches
// and gaps, not bytes. Lane l holds experts l, l + 32, ...: EPL = ceil(E / 32) values per lane (E <= 1024),
// and lane j < K holds the j-th choice (K <= 32). Reductions are xor-shuffle trees in a fixed order: the
// results are deterministic. The build passes --use_fast_math, under which expf is __expf (error growing with
// |x|: ~10 ulp at x = -16) and '/' an approximate division: exp is taken in double and rounded once, and divisions
// are __fdiv_rn, so the kernel stays within 2x of torch's own fp32 softmax error.
#include "lf_cuda_utils.cuh"
#include "moe_dispatch_checks.h"

namespace loongforge {
namespace {

constexpr int kRouterThreads = 256;  // 8 tokens per block

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// torch.topk's order: NaN above every number
__device__ __forceinline__ float topk_key(float p) { return isnan(p) ? INFINITY : p; }

template <typename T, int EPL>
__global__ void __launch_bounds__(kRouterThreads)
    router_topk_fwd_kernel(const T* __restrict__ logits, int64_t tokens, int experts, int k, bool renormalize,
                           float* __restrict__ probs, float* __restrict__ weights, int64_t* __restrict__ ids) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); t < tokens;
         t += warps) {
        const T* row = logits + t * experts;
        float p[EPL];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int e = lane + 32 * i;
            p[i] = e < experts ? static_cast<float>(row[e]) : -INFINITY;
            mx = fmaxf(mx, p[i]);
        }
        mx = warp_max(mx);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int e = lane + 32 * i;
            p[i] = e < experts ? static_cast<float>(exp(static_cast<double>(p[i] - mx))) : 0.f;
            sum += p[i];
        }
        sum = warp_sum(sum);
        float* prow = probs + t * experts;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int e = lane + 32 * i;
            p[i] = __fdiv_rn(p[i], sum);
            if (e < experts) prow[e] = p[i];
        }
        // k rounds of a warp argmax over the experts not chosen yet
        unsigned chosen = 0u;  // bit i: expert lane + 32 i is taken
        float my_p = 0.f;      // lane j: the j-th choice
        int my_e = 0;
        float chosen_sum = 0.f;
        for (int j = 0; j < k; ++j) {
            float best = -INFINITY;
            int best_e = experts;  // past every expert: loses every tie
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                const int e = lane + 32 * i;
                const float key = topk_key(p[i]);
                if (e < experts && !((chosen >> i) & 1u) && (key > best || best_e == experts)) {
                    best = key;  // ascending e within a lane: a strict > keeps the lowest expert of a tie
                    best_e = e;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float other = __shfl_xor_sync(0xffffffffu, best, o);
                const int other_e = __shfl_xor_sync(0xffffffffu, best_e, o);
                if (other > best || (other == best && other_e < best_e)) {
                    best = other;
                    best_e = other_e;
                }
            }
            if ((best_e & 31) == lane) chosen |= 1u << (best_e >> 5);
            const float value = best == INFINITY ? NAN : best;  // a probability is at most 1: INFINITY is NaN
            chosen_sum += value;
            if (lane == j) {
                my_p = value;
                my_e = best_e;
            }
        }
        if (lane < k) {
            weights[t * k + lane] = renormalize ? __fdiv_rn(my_p, chosen_sum) : my_p;
            ids[t * k + lane] = my_e;
        }
    }
}

template <typename T, int EPL>
__global__ void __launch_bounds__(kRouterThreads)
    router_topk_bwd_kernel(const float* __restrict__ dweights, const float* __restrict__ dprobs,
                           const float* __restrict__ probs, const int64_t* __restrict__ ids, int64_t tokens,
                           int experts, int k, bool renormalize, T* __restrict__ dlogits) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); t < tokens;
         t += warps) {
        const float* prow = probs + t * experts;
        float p[EPL], dp[EPL];
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int e = lane + 32 * i;
            p[i] = e < experts ? prow[e] : 0.f;
            dp[i] = (e < experts && dprobs != nullptr) ? dprobs[t * experts + e] : 0.f;
        }
        const bool holds = lane < k;
        const int my_e = holds ? static_cast<int>(ids[t * k + lane]) : 0;
        const float my_dw = holds ? dweights[t * k + lane] : 0.f;
        float g = my_dw;
        if (renormalize) {
            const float my_p = holds ? prow[my_e] : 0.f;
            const float s = warp_sum(my_p);
            const float dot = warp_sum(holds ? my_dw * __fdiv_rn(my_p, s) : 0.f);
            g = __fdiv_rn(my_dw - dot, s);
        }
        for (int j = 0; j < k; ++j) {
            const int e = __shfl_sync(0xffffffffu, my_e, j);
            const float gj = __shfl_sync(0xffffffffu, g, j);
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                if (lane + 32 * i == e) dp[i] += gj;
            }
        }
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) dot = fmaf(p[i], dp[i], dot);
        dot = warp_sum(dot);
        T* drow = dlogits + t * experts;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            const int e = lane + 32 * i;
            if (e < experts) drow[e] = static_cast<T>(p[i] * (dp[i] - dot));
        }
    }
}

// Run fn.template operator()<EPL>() with the fewest values per lane that hold E experts.
void dispatch_epl(int experts, const auto& fn) {
    if (experts <= 32) fn.template operator()<1>();
    else if (experts <= 64) fn.template operator()<2>();
    else if (experts <= 128) fn.template operator()<4>();
    else if (experts <= 256) fn.template operator()<8>();
    else if (experts <= 512) fn.template operator()<16>();
    else fn.template operator()<32>();
}

dim3 router_grid(int64_t tokens) {
    const int64_t per_block = kRouterThreads / 32;
    const int64_t max_blocks = static_cast<int64_t>(lf_sm_count()) * 16;
    return dim3(static_cast<unsigned>(std::min(max_blocks, (tokens + per_block - 1) / per_block)));
}

}  // namespace

void moe_router_topk_fwd_cuda(const at::Tensor& logits_TE, int64_t k, bool renormalize, const at::Tensor& probs_TE,
                              const at::Tensor& weights_TK, const at::Tensor& ids_TK) {
    const int64_t tokens = logits_TE.size(0);
    const int experts = static_cast<int>(logits_TE.size(1));
    const c10::cuda::CUDAGuard guard(logits_TE.device());
    if (tokens == 0) return;
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(logits_TE.scalar_type(), "moe_router_topk", [&] {
        using T = scalar_t;
        dispatch_epl(experts, [&]<int EPL>() {
            router_topk_fwd_kernel<T, EPL><<<router_grid(tokens), kRouterThreads, 0, stream>>>(
                logits_TE.data_ptr<T>(), tokens, experts, static_cast<int>(k), renormalize,
                probs_TE.data_ptr<float>(), weights_TK.data_ptr<float>(), ids_TK.data_ptr<int64_t>());
            LF_CUDA_CHECK_LAUNCH();
        });
    });
}

void moe_router_topk_bwd_cuda(const at::Tensor& dweights_TK, const at::Tensor& dprobs_TE, const at::Tensor& probs_TE,
                              const at::Tensor& ids_TK, bool renormalize, const at::Tensor& dlogits_TE) {
    const int64_t tokens = probs_TE.size(0);
    const int experts = static_cast<int>(probs_TE.size(1));
    const int k = static_cast<int>(ids_TK.size(1));
    const c10::cuda::CUDAGuard guard(probs_TE.device());
    if (tokens == 0) return;
    auto stream = c10::cuda::getCurrentCUDAStream();
    LF_DISPATCH_FLOATING(dlogits_TE.scalar_type(), "moe_router_topk_bwd", [&] {
        using T = scalar_t;
        dispatch_epl(experts, [&]<int EPL>() {
            router_topk_bwd_kernel<T, EPL><<<router_grid(tokens), kRouterThreads, 0, stream>>>(
                dweights_TK.data_ptr<float>(), dprobs_TE.defined() ? dprobs_TE.data_ptr<float>() : nullptr,
                probs_TE.data_ptr<float>(), ids_TK.data_ptr<int64_t>(), tokens, experts, k, renormalize,
                dlogits_TE.data_ptr<T>());
            LF_CUDA_CHECK_LAUNCH();
        });
    });
}

}  // namespace loongforge
