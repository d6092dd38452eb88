// Device helpers shared by the CUDA kernels: 16-byte vector access and row reductions.
#pragma once

// c10's CUDA headers only: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers, which a
// minimal CUDA toolkit lacks, and lengthen every nvcc run.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>

#include "lf_common.h"

namespace loongforge {

// At most 16-byte alignment is required, so a 32-byte vector (8 floats) needs only 16-byte-aligned
// addresses and compiles to two 128-bit accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Vec {
    T val[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* __restrict__ p) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, N>& v) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// lf_round_to<T> of two values with one packed conversion (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32: round to
// nearest even, as the scalar cast): a and b come back as floats, and `pair` (when not null) receives the two T
// values, a in the lower half. sm_90 runs the scalar F2F conversions at a quarter of the FP32 rate; one packed
// F2FP rounds two values. The identity for float (`pair` then gets a and b as they are).
template <typename T>
__device__ __forceinline__ void lf_round_pair(float& a, float& b, T* pair = nullptr) {
    if constexpr (std::is_same_v<T, float>) {
        if (pair != nullptr) {
            pair[0] = a;
            pair[1] = b;
        }
    } else {
        using P = std::conditional_t<std::is_same_v<T, at::BFloat16>, __nv_bfloat162, __half2>;
        static_assert(std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>, "float, bf16 or fp16");
        P r;
        if constexpr (std::is_same_v<T, at::BFloat16>) {
            r = __floats2bfloat162_rn(a, b);
        } else {
            r = __floats2half2_rn(a, b);
        }
        a = __low2float(r);
        b = __high2float(r);
        if (pair != nullptr) *reinterpret_cast<P*>(pair) = r;
    }
}

// Sum `v` over the `tpr` threads (threadIdx.x) that share one row (threadIdx.y). `tpr` is a power of
// two below 32 or a multiple of 32; the block holds a whole number of warps. `smem` holds 32 floats
// per row. Every thread of the block must call this (it may hold barriers). The summation order is
// fixed, so results are deterministic.
__device__ __forceinline__ float row_allreduce_sum(float v, float* smem, int tpr) {
    const int width = tpr < 32 ? tpr : 32;
    for (int offset = width / 2; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    if (tpr <= 32) return v;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    float* row_smem = smem + threadIdx.y * 32;
    if (lane == 0) row_smem[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < tpr / 32; ++w) total += row_smem[w];
    __syncthreads();
    return total;
}

inline int lf_sm_count() {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
}

// Resident blocks of `kernel` per SM at `threads` threads and no dynamic shared memory, asked of the runtime
// once per (device, kernel, threads): cudaOccupancyMaxActiveBlocksPerMultiprocessor reads the kernel's attributes
// from the driver at every call, which cost more host time per RMSNorm backward on the H200 than its launches,
// while the answer never changes for a given kernel, block size and device.
template <typename Kernel>
int lf_max_blocks_per_sm(Kernel kernel, int threads) {
    static std::mutex lock;
    static std::map<std::tuple<int, const void*, int>, int> known;
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), threads);
    std::lock_guard<std::mutex> guard(lock);
    auto found = known.find(key);
    if (found != known.end()) return found->second;
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
    known.emplace(key, per_sm);
    return per_sm;
}

inline bool lf_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace loongforge

#define LF_CUDA_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()
