// What the grouped GEMM's instantiations (grouped_gemm_kernel.cuh, CUTLASS) and its dispatcher
// (grouped_gemm.cu, no CUTLASS: it compiles in seconds) share.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace loongforge {
namespace grouped_gemm {

enum class Mode : int { kRowsBNK = 0, kRowsBKN = 1, kWgrad = 2 };

struct Call {
    const void* a;
    const void* b;
    void* d;
    const int32_t* offs;  // [groups] inclusive group ends (rows mode: rows of x; wgrad: rows of a and b)
    int groups;
    int m, n, k;          // rows: n, k (m unused); wgrad: m, n (k ragged)
    Mode mode;
    int sm_count;
    cudaStream_t stream;
};

// one instantiation per (mode, tile configuration): <fn>_<config> in grouped_gemm_<mode>_<config>.cu.
// Configurations: 0 cooperative 128x256x64 (torch's F.grouped_mm tile), 1 cooperative 256x128x64 (cluster 1x2),
// 2 pingpong 128x128x64.
constexpr int kConfigs = 3;
#define LF_GROUPED_GEMM_DECLARE(fn)                           \
    void fn##_0(const Call& call, const at::Tensor& like);    \
    void fn##_1(const Call& call, const at::Tensor& like);    \
    void fn##_2(const Call& call, const at::Tensor& like);
LF_GROUPED_GEMM_DECLARE(run_rows_bnk)
LF_GROUPED_GEMM_DECLARE(run_rows_bkn)
LF_GROUPED_GEMM_DECLARE(run_wgrad)
#undef LF_GROUPED_GEMM_DECLARE

}  // namespace grouped_gemm
}  // namespace loongforge
