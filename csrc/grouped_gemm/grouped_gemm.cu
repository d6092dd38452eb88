// The grouped GEMM's torch-facing functions: input checks, output allocation, the zero gradient of groups with
// no rows, and the choice of instantiation. No CUTLASS here (grouped_gemm_kernel.cuh holds it).
#include <algorithm>

#include "grouped_gemm_api.h"
#include "lf_common.h"
#include "lf_cuda_utils.cuh"

namespace loongforge {
namespace grouped_gemm {
namespace {

// D[g] = 0 for every group whose count (offs[g] - offs[g-1]) is zero; other groups are not touched. Grid:
// (chunks, groups); each block reads its group's two ends and leaves at once unless the group is empty.
__global__ void zero_empty_groups_kernel(const int32_t* __restrict__ offs, uint4* __restrict__ d,
                                         int64_t vecs_per_group) {
    const int g = blockIdx.y;
    const int32_t start = g == 0 ? 0 : offs[g - 1];
    if (offs[g] != start) return;
    uint4* out = d + static_cast<int64_t>(g) * vecs_per_group;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs_per_group;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        out[i] = make_uint4(0, 0, 0, 0);
    }
}

void check_operand(const at::Tensor& t, const char* name, int64_t dims) {
    LF_CHECK(t.is_cuda(), "grouped_gemm: ", name, " must be a CUDA tensor, got one on ", t.device());
    LF_CHECK(t.scalar_type() == at::kBFloat16, "grouped_gemm: ", name, " must be bfloat16, got ", t.scalar_type());
    LF_CHECK(t.dim() == dims, "grouped_gemm: ", name, " must have ", dims, " dimensions, got shape ", t.sizes());
    LF_CHECK(t.is_contiguous(), "grouped_gemm: ", name, " must be contiguous (shape ", t.sizes(), ", strides ",
             t.strides(), "); call .contiguous() first");
    LF_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "grouped_gemm: ", name,
             " must start on a 16-byte boundary (TMA); it is a view at an odd offset");
    LF_CHECK(t.size(-1) % 8 == 0, "grouped_gemm: ", name, "'s rows must hold a multiple of 8 elements (16 bytes "
             "for TMA), got ", t.size(-1));
}

void check_offs(const at::Tensor& offs, const at::Tensor& like, int64_t groups) {
    LF_CHECK(offs.device() == like.device(), "grouped_gemm: offs must be on ", like.device(), ", got ",
             offs.device());
    LF_CHECK(offs.scalar_type() == at::kInt && offs.dim() == 1 && offs.is_contiguous(),
             "grouped_gemm: offs must be a contiguous 1-D int32 tensor of group ends, got ", offs.scalar_type(),
             " of shape ", offs.sizes());
    LF_CHECK(offs.size(0) == groups, "grouped_gemm: offs must hold one end per group (", groups, "), got ",
             offs.size(0));
    LF_CHECK(groups >= 1, "grouped_gemm: at least one group is needed, got ", groups);
}

void check_config(int64_t config) {
    LF_CHECK(config >= 0 && config < kConfigs, "grouped_gemm: config must be 0..", kConfigs - 1, ", got ", config);
}

int sm_count() {
    static int count[64] = {0};
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= 64) return lf_sm_count();
    if (count[dev] == 0) count[dev] = lf_sm_count();
    return count[dev];
}

void check_hopper() {
    int dev = 0, major = 0, minor = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    LF_CHECK(major == 9 && minor == 0, "grouped_gemm: this kernel is built for sm_90a (H100/H200), the tensors are "
             "on a device of compute capability ", major, ".", minor, "; use the layer's expert_compute="
             "'grouped_mm' or 'loop' there");
}

using Instance = void (*)(const Call&, const at::Tensor&);
constexpr Instance kRowsBNK[kConfigs] = {run_rows_bnk_0, run_rows_bnk_1, run_rows_bnk_2};
constexpr Instance kRowsBKN[kConfigs] = {run_rows_bkn_0, run_rows_bkn_1, run_rows_bkn_2};
constexpr Instance kWgrad[kConfigs] = {run_wgrad_0, run_wgrad_1, run_wgrad_2};

}  // namespace

// x [P, K] (rows grouped by offs) times W[g]: w [G, N, K] (w_nk: y = x W[g]^T) or [G, K, N] -> [P, N]
at::Tensor grouped_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, bool w_nk,
                        int64_t config) {
    check_operand(x, "x", 2);
    check_operand(w, "w", 3);
    check_offs(offs, x, w.size(0));
    check_config(config);
    LF_CHECK(w.device() == x.device(), "grouped_gemm: w must be on ", x.device(), ", got ", w.device());
    const int64_t k = x.size(1);
    const int64_t n = w_nk ? w.size(1) : w.size(2);
    const int64_t w_k = w_nk ? w.size(2) : w.size(1);
    LF_CHECK(w_k == k, "grouped_gemm: x has ", k, " columns but w's inner dimension is ", w_k, " (w shape ",
             w.sizes(), ", w_nk=", w_nk, ")");
    LF_CHECK(x.size(0) < (int64_t{1} << 31) && n < (int64_t{1} << 31) && k < (int64_t{1} << 31),
             "grouped_gemm: sizes must fit in int32, got x ", x.sizes(), " and w ", w.sizes());
    c10::cuda::CUDAGuard guard(x.device());
    check_hopper();
    at::Tensor out = at::empty({x.size(0), n}, x.options());
    if (x.size(0) == 0 || n == 0) return out;
    Call call{x.data_ptr(), w.data_ptr(), out.data_ptr(), offs.data_ptr<int32_t>(), static_cast<int>(w.size(0)),
              0, static_cast<int>(n), static_cast<int>(k), w_nk ? Mode::kRowsBNK : Mode::kRowsBKN, sm_count(),
              c10::cuda::getCurrentCUDAStream().stream()};
    if (k == 0) return out.zero_();
    (w_nk ? kRowsBNK : kRowsBKN)[config](call, x);
    return out;
}

// D[g] = a[rows of g]^T b[rows of g]: a [P, M], b [P, N] -> [G, M, N]; a group with no rows gets zeros
at::Tensor grouped_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, int64_t config) {
    check_operand(a, "a", 2);
    check_operand(b, "b", 2);
    check_config(config);
    LF_CHECK(offs.dim() == 1, "grouped_gemm: offs must be 1-D, got shape ", offs.sizes());
    const int64_t groups = offs.size(0);
    check_offs(offs, a, groups);
    LF_CHECK(b.device() == a.device(), "grouped_gemm: b must be on ", a.device(), ", got ", b.device());
    LF_CHECK(a.size(0) == b.size(0), "grouped_gemm: a and b must have the same rows, got ", a.sizes(), " and ",
             b.sizes());
    LF_CHECK(a.size(1) < (int64_t{1} << 31) && b.size(1) < (int64_t{1} << 31),
             "grouped_gemm: sizes must fit in int32, got a ", a.sizes(), " and b ", b.sizes());
    c10::cuda::CUDAGuard guard(a.device());
    check_hopper();
    const int64_t m = a.size(1), n = b.size(1);
    at::Tensor out = at::empty({groups, m, n}, a.options());
    if (m == 0 || n == 0) return out;
    auto stream = c10::cuda::getCurrentCUDAStream().stream();
    Call call{a.data_ptr(), b.data_ptr(), out.data_ptr(), offs.data_ptr<int32_t>(), static_cast<int>(groups),
              static_cast<int>(m), static_cast<int>(n), 0, Mode::kWgrad, sm_count(), stream};
    const int64_t vecs = m * n * 2 / 16;  // n % 8 == 0: whole 16-byte vectors per group
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>((vecs + 255) / 256, 64)), static_cast<unsigned>(groups));
    zero_empty_groups_kernel<<<grid, 256, 0, stream>>>(offs.data_ptr<int32_t>(),
                                                       static_cast<uint4*>(out.data_ptr()), vecs);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (a.size(0) == 0) return out;
    kWgrad[config](call, a);
    return out;
}

}  // namespace grouped_gemm
}  // namespace loongforge
