// MoE routing indices on CUDA: the stable counting sort of the P = T*K token-expert pairs by expert; and the
// top-k choice counts of the balancing loss (topk_counts_kernel, at the end).
// Legend: T tokens, K experts per token, P pairs (pair i = t*K + j is token t's j-th expert), E experts.
//
//   slot_TK[i]     = start[e(i)] + #{pairs i' < i with e(i') = e(i)}   (expert-major position of pair i)
//   order_P[slot]  = i                                                  (the inverse permutation)
//   counts_E[e]    = #{pairs with e(i) = e}, offsets_E[e] = counts_E[0] + ... + counts_E[e] (int32, for
//                    grouped GEMM), start[e] = offsets_E[e] - counts_E[e]
//
// This is exactly torch.sort(ids, stable=True)'s order, in three kernels where the sort, the inverse
// scatter, the searchsorted counts and the cumsum took about ten ops (each a host-side launch: the forward
// of an e2e step was bound by how fast the host issued them). No host sync, no order-dependent atomics:
//   1. count: each block of kChunk consecutive pairs histograms its experts in shared memory (integer
//      atomics, whose result does not depend on their order) into hist[block][e];
//   2. scan (one block, bucket-major over the counters): counts_E and offsets_E, and hist[block][e] becomes the expert-major position of the
//      block's first pair of expert e (pairs of e in earlier blocks come first: stability across blocks);
//   3. rank: one warp per block walks its pairs in order, 32 at a time; lanes holding the same expert find
//      each other with __match_any_sync and take consecutive positions in lane order (stability within the
//      block), and the lowest of them advances that expert's position for the next 32.
// Ids outside [0, E) go to an extra bucket after every expert: they get positions past offsets_E[E - 1] (so
// slot_TK stays a permutation and no row is written twice), and counts_E does not count them. The CPU build
// and the Python op reject them instead (checking here would cost a host sync).
// Preconditions (checked by the binding): ids_TK contiguous int64 on this device, P < 2^31 - 1,
// E <= kMaxRoutingExperts.
// Cost: three launches and P * 20 bytes of ids, slots and order; the scan block spreads the (P / kChunk) x (E + 1)
// counters over its 1024 threads (benchmarks/diagnose_routing.py times it against torch's stable sort).
#include "lf_cuda_utils.cuh"
#include "moe_dispatch_checks.h"

namespace loongforge {
namespace {

constexpr int kChunk = 1024;        // pairs per block in the count and rank kernels
constexpr int kCountThreads = 256;
constexpr int kScanThreads = 1024;

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
    int* out = hist + static_cast<int64_t>(blockIdx.x) * buckets;
    for (int e = threadIdx.x; e < buckets; e += blockDim.x) out[e] = local[e];
}

// One block: an exclusive scan over every block's counter of every bucket, taken bucket-major ((e, b) in the order
// e = 0..E, b = 0..blocks - 1, so a bucket's pairs in earlier blocks come first). Thread t owns the cells
// [t * per, (t + 1) * per) of that order: it sums them (independent loads), the threads' sums are scanned, and it
// walks them again writing each cell's start; the thread holding a bucket's last cell writes its end
// (offsets_E), and counts_E is the difference of consecutive ends. Every thread has work at any P and E: a
// thread per bucket walking all P / kChunk counters of its bucket (one after the other, twice) made this block
// the kernel's longest part at millions of pairs.
__global__ void __launch_bounds__(kScanThreads)
    routing_scan_kernel(int* __restrict__ hist, int blocks, int experts, int64_t* __restrict__ counts,
                        int* __restrict__ offsets) {
    __shared__ int64_t sums[kScanThreads];
    const int buckets = experts + 1;
    const int64_t cells = static_cast<int64_t>(blocks) * buckets;
    const int64_t per = (cells + kScanThreads - 1) / kScanThreads;
    const int64_t lo = min(cells, static_cast<int64_t>(threadIdx.x) * per);
    const int64_t hi = min(cells, lo + per);
    int64_t mine = 0;
    {
        int e = static_cast<int>(lo / blocks), b = static_cast<int>(lo % blocks);
        for (int64_t c = lo; c < hi; ++c) {
            mine += hist[static_cast<int64_t>(b) * buckets + e];
            if (++b == blocks) b = 0, ++e;
        }
    }
    sums[threadIdx.x] = mine;
    __syncthreads();
    for (int step = 1; step < kScanThreads; step <<= 1) {  // inclusive Hillis-Steele scan
        const int64_t add = threadIdx.x >= step ? sums[threadIdx.x - step] : 0;
        __syncthreads();
        sums[threadIdx.x] += add;
        __syncthreads();
    }
    int64_t start = sums[threadIdx.x] - mine;
    {
        int e = static_cast<int>(lo / blocks), b = static_cast<int>(lo % blocks);
        for (int64_t c = lo; c < hi; ++c) {
            int* cell = hist + static_cast<int64_t>(b) * buckets + e;
            const int count = *cell;
            *cell = static_cast<int>(start);
            start += count;
            if (b == blocks - 1 && e < experts) offsets[e] = static_cast<int>(start);
            if (++b == blocks) b = 0, ++e;
        }
    }
    __syncthreads();  // a block's global writes are visible to the block after its barrier
    for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = offsets[e] - (e > 0 ? offsets[e - 1] : 0);
}

__global__ void __launch_bounds__(32)
    routing_rank_kernel(const int64_t* __restrict__ ids, int64_t pairs, int experts, const int* __restrict__ hist,
                        int64_t* __restrict__ slot, int64_t* __restrict__ order) {
    extern __shared__ int next[];  // experts + 1: the next free position of each bucket for this block
    const int buckets = experts + 1;
    const int lane = threadIdx.x;
    const int* base = hist + static_cast<int64_t>(blockIdx.x) * buckets;
    for (int e = lane; e < buckets; e += 32) next[e] = base[e];
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
    auto hist = at::empty({static_cast<int64_t>(blocks) * (experts + 1)}, ids_TK.options().dtype(at::kInt));
    const int64_t* ids = ids_TK.data_ptr<int64_t>();
    routing_count_kernel<<<blocks, kCountThreads, shared, stream>>>(ids, pairs, experts, hist.data_ptr<int>());
    LF_CUDA_CHECK_LAUNCH();
    routing_scan_kernel<<<1, kScanThreads, 0, stream>>>(hist.data_ptr<int>(), blocks, experts,
                                                        counts_E.data_ptr<int64_t>(), offsets_E.data_ptr<int>());
    LF_CUDA_CHECK_LAUNCH();
    routing_rank_kernel<<<blocks, 32, shared, stream>>>(ids, pairs, experts, hist.data_ptr<int>(),
                                                        slot_TK.data_ptr<int64_t>(), order_P.data_ptr<int64_t>());
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
