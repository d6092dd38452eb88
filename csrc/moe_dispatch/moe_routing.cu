// MoE routing indices on CUDA: the stable counting sort of the P = T*K token-expert pairs by expert; and the
// top-k choice counts of the balancing loss (topk_counts_kernel, at the end).
// Legend: T tokens, K experts per token, P pairs (pair i = t*K + j is token t's j-th expert), E experts.
//
//   slot_TK[i]     = start[e(i)] + #{pairs i' < i with e(i') = e(i)}   (expert-major position of pair i)
//   order_P[slot]  = i                                                  (the inverse permutation)
//   counts_E[e]    = #{pairs with e(i) = e}, offsets_E[e] = counts_E[0] + ... + counts_E[e] (int32, for
//                    grouped GEMM), start[e] = offsets_E[e] - counts_E[e]
//
// This is exactly torch.sort(ids, stable=True)'s order, from one host call (count, CUB's scan, finish, rank) where
// the sort, the inverse scatter, the searchsorted counts and the cumsum took about ten ops (each a host-side
// launch: the forward of an e2e step was bound by how fast the host issued them). No host sync, no
// order-dependent atomics:
//   1. count: each block of kChunk consecutive pairs histograms its experts in shared memory (integer
//      atomics, whose result does not depend on their order) into hist[e][block], bucket-major;
//   2. scan: torch's device-wide CUB exclusive sum over hist in that order, so starts[e][block] is the
//      expert-major position of the block's first pair of expert e (pairs of e in earlier blocks come first:
//      stability across blocks); a small kernel reads counts_E and offsets_E off the bucket boundaries;
//   3. rank: one warp per block walks its pairs in order, 32 at a time; lanes holding the same expert find
//      each other with __match_any_sync and take consecutive positions in lane order (stability within the
//      block), and the lowest of them advances that expert's position for the next 32.
// Ids outside [0, E) go to an extra bucket after every expert: they get positions past offsets_E[E - 1] (so
// slot_TK stays a permutation and no row is written twice), and counts_E does not count them. The CPU build
// and the Python op reject them instead (checking here would cost a host sync).
// Preconditions (checked by the binding): ids_TK contiguous int64 on this device, P < 2^31 - 1,
// E <= kMaxRoutingExperts.
// Cost: P * 32 bytes (ids read twice, slot and order written) and (P / kChunk) x (E + 1) counters written,
// scanned and read.
// The scan was one 1024-thread block before (a thread per expert walking every block's counter at 42005ae, the
// counters spread over its threads but read uncoalesced at ea99d7e): at millions of pairs, or 256 experts, it
// took most of the op's time (benchmarks/diagnose_routing.py times the op against torch's stable sort and
// another tree's build).
#include <ATen/cuda/cub.h>

#include "lf_cuda_utils.cuh"
#include "moe_dispatch_checks.h"

namespace loongforge {
namespace {

constexpr int kChunk = 1024;        // pairs per block in the count and rank kernels
constexpr int kCountThreads = 256;
constexpr int kFinishThreads = 256;

__device__ __forceinline__ int expert_bucket(int64_t id, int experts) {
    return (id >= 0 && id < experts) ? static_cast<int>(id) : experts;
}

__global__ void __launch_bounds__(kCountThreads)
    routing_count_kernel(const int64_t* __restrict__ ids, int64_t pairs, int experts, int* __restrict__ hist) {
    extern __shared__ int local[];  // experts + 1 buckets
    const int buckets = experts + 1;
    for (int e = threadIdx.x; e < buckets; e += blockDim.x) local[e] = 0;
    __syncthreads();
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
    const int64_t end = min(pairs, begin + kChunk);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        atomicAdd(&local[expert_bucket(ids[i], experts)], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < buckets; e += blockDim.x) {
        hist[static_cast<int64_t>(e) * gridDim.x + blockIdx.x] = local[e];  // bucket-major
    }
}

// counts_E and offsets_E from the exclusive scan of the bucket-major counters: bucket e's pairs start at
// starts[e * blocks] and end where bucket e + 1's start (the out-of-range bucket E is always there).
__global__ void __launch_bounds__(kFinishThreads)
    routing_finish_kernel(const int* __restrict__ starts, int blocks, int experts, int64_t* __restrict__ counts,
                          int* __restrict__ offsets) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= experts) return;
    const int begin = starts[static_cast<int64_t>(e) * blocks];
    const int end = starts[static_cast<int64_t>(e + 1) * blocks];
    counts[e] = end - begin;
    offsets[e] = end;
}

__global__ void __launch_bounds__(32)
    routing_rank_kernel(const int64_t* __restrict__ ids, int64_t pairs, int experts, const int* __restrict__ starts,
                        int64_t* __restrict__ slot, int64_t* __restrict__ order) {
    extern __shared__ int next[];  // experts + 1: the next free position of each bucket for this block
    const int buckets = experts + 1;
    const int lane = threadIdx.x;
    for (int e = lane; e < buckets; e += 32) next[e] = starts[static_cast<int64_t>(e) * gridDim.x + blockIdx.x];
    __syncwarp();
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
    const int64_t end = min(pairs, begin + kChunk);
    const unsigned below = (1u << lane) - 1u;
    for (int64_t i0 = begin; i0 < end; i0 += 32) {  // the same trip count for every lane
        const int64_t i = i0 + lane;
        const bool valid = i < end;
        const unsigned active = __ballot_sync(0xffffffffu, valid);
        int e = 0;
        unsigned peers = 0;
        int pos = 0;
        if (valid) {
            e = expert_bucket(ids[i], experts);
            peers = __match_any_sync(active, e);
            pos = next[e] + __popc(peers & below);
            slot[i] = pos;
            order[pos] = i;
        }
        __syncwarp();  // every lane has read next[e] before the lowest lane of its group moves it
        if (valid && lane == __ffs(peers) - 1) next[e] += __popc(peers);
        __syncwarp();
    }
}

// Top-k choice counts, for the Switch load-balancing loss (integrations/balancing_loss.py): thread per row; k
// rounds each take the largest rank key (topk_rank_key) below the previous round's, so a row's choices are
// torch.topk's set, ties to the lower column. Block counters in shared memory and one global add per block and
// column: integer atomics, so the counts do not depend on their order.
constexpr int kTopKCountThreads = 256;
constexpr int kTopKCountMaxBlocks = 1024;

template <typename T>
__global__ void __launch_bounds__(kTopKCountThreads)
    topk_counts_kernel(const T* __restrict__ values, int64_t rows, int columns, int k,
                       const int64_t* __restrict__ weights, int64_t period, unsigned long long* __restrict__ counts) {
    extern __shared__ unsigned long long block_counts[];  // columns
    for (int e = threadIdx.x; e < columns; e += blockDim.x) block_counts[e] = 0ull;
    __syncthreads();
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
        const T* row = values + r * columns;
        const unsigned long long w = weights != nullptr ? static_cast<unsigned long long>(weights[r % period]) : 1ull;
        uint64_t previous = ~0ull;
        for (int j = 0; j < k; ++j) {
            uint64_t best = 0ull;
            for (int e = 0; e < columns; ++e) {
                const uint64_t key = topk_rank_key(static_cast<float>(row[e]), e);
                if (key < previous && key > best) best = key;
            }
            atomicAdd(&block_counts[0xfffffffeu - static_cast<uint32_t>(best)], w);
            previous = best;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < columns; e += blockDim.x) {
        if (block_counts[e] != 0ull) atomicAdd(&counts[e], block_counts[e]);
    }
}

}  // namespace

void moe_routing_indices_cuda(const at::Tensor& ids_TK, int64_t num_experts, const at::Tensor& order_P,
                              const at::Tensor& slot_TK, const at::Tensor& counts_E, const at::Tensor& offsets_E) {
    const int64_t pairs = ids_TK.numel();
    const int experts = static_cast<int>(num_experts);
    const c10::cuda::CUDAGuard guard(ids_TK.device());
    if (pairs == 0) {
        counts_E.zero_();
        offsets_E.zero_();
        return;
    }
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int blocks = static_cast<int>((pairs + kChunk - 1) / kChunk);
    const size_t shared = static_cast<size_t>(experts + 1) * sizeof(int);
    const int64_t cells = static_cast<int64_t>(blocks) * (experts + 1);
    auto hist = at::empty({2, cells}, ids_TK.options().dtype(at::kInt));  // the counters, then their scan
    int* counters = hist.data_ptr<int>();
    int* starts = counters + cells;
    const int64_t* ids = ids_TK.data_ptr<int64_t>();
    routing_count_kernel<<<blocks, kCountThreads, shared, stream>>>(ids, pairs, experts, counters);
    LF_CUDA_CHECK_LAUNCH();
    // torch's device-wide CUB scan (decoupled look-back over every SM; no host sync, temporary storage from the
    // caching allocator): every value is at most P < 2^31 - 1
    at::cuda::cub::exclusive_sum_in_common_type<int, int>(counters, starts, cells);
    routing_finish_kernel<<<(experts + kFinishThreads - 1) / kFinishThreads, kFinishThreads, 0, stream>>>(
        starts, blocks, experts, counts_E.data_ptr<int64_t>(), offsets_E.data_ptr<int>());
    LF_CUDA_CHECK_LAUNCH();
    routing_rank_kernel<<<blocks, 32, shared, stream>>>(ids, pairs, experts, starts, slot_TK.data_ptr<int64_t>(),
                                                        order_P.data_ptr<int64_t>());
    LF_CUDA_CHECK_LAUNCH();
}

void moe_topk_counts_cuda(const at::Tensor& values_RE, int64_t k, const at::Tensor& weights_R,
                          const at::Tensor& counts_E) {
    const int64_t rows = values_RE.size(0);
    const int columns = static_cast<int>(values_RE.size(1));
    const c10::cuda::CUDAGuard guard(values_RE.device());
    if (rows == 0) return;  // counts_E arrives zeroed
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t wanted = (rows + kTopKCountThreads - 1) / kTopKCountThreads;
    const int blocks = static_cast<int>(wanted < kTopKCountMaxBlocks ? wanted : kTopKCountMaxBlocks);
    const size_t shared = static_cast<size_t>(columns) * sizeof(unsigned long long);
    static_assert(sizeof(unsigned long long) == sizeof(int64_t), "int64 counters");
    LF_DISPATCH_FLOATING(values_RE.scalar_type(), "moe_topk_counts", [&] {
        using T = scalar_t;
        topk_counts_kernel<T><<<blocks, kTopKCountThreads, shared, stream>>>(
            values_RE.data_ptr<T>(), rows, columns, static_cast<int>(k),
            weights_R.defined() ? weights_R.data_ptr<int64_t>() : nullptr,
            weights_R.defined() ? weights_R.numel() : 1,
            reinterpret_cast<unsigned long long*>(counts_E.data_ptr<int64_t>()));
        LF_CUDA_CHECK_LAUNCH();
    });
}

}  // namespace loongforge
