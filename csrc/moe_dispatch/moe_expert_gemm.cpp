// One GEMM of one expert, for the MoE experts' backward on CUDA (the loop over experts is the binding's
// expert_linear_bwd), through cuBLASLt with the algorithm of each problem class chosen once per process.
//
// Why not torch.mm per expert: with fresh routing every step, an expert's row count is new almost every call, and
// cuBLAS then runs its heuristic again. On the H200 that cost ~380 us of host time a GEMM with fresh group sizes
// against ~23 us with repeated ones (benchmarks/diagnose_grouped_gemm --host-cost, a811de5), far more than the
// per-expert GEMMs save on the device. Here the heuristic is asked once per (dtype, layout, fixed sizes, alignment,
// bucket of the row count): the row count rounded up to 8 steps an octave (at least 16 rows a step). The algorithm
// found for the bucket's upper end then runs the actual size; where cuBLASLt refuses it, the exact size is asked
// for (and kept), and where no algorithm exists at all, at::mm_out runs the product.
//
// Numerics: fp32 accumulation, one rounding to the output dtype, and split-K partial sums only in fp32
// (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE): never the reduced-precision output-type reductions torch allows by
// default for bf16. An algorithm is a fixed function of the problem, so results are deterministic.
//
// Row-major products in cuBLAS's column-major terms (a row-major [r, c] matrix is a column-major [c, r] one):
//   rows:  out[n, N] = a[n, K] @ b[K, N]      ->  out^T (N x n) = b^T (N x K) . a^T (K x n)    m=N n=n k=K
//   wgrad: out[M, N] = a[n, M]^T @ b[n, N]    ->  out^T (N x M) = b^T (N x n) . a (n x M)      m=N n=M k=n
// so A is always b (op N, lda = m) and B is a (op N with ldb = K, or op T with ldb = M); the varying row count is
// cuBLAS's n for "rows" and its k for "wgrad", never a leading dimension.
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>
#include <tuple>
#include <unordered_map>

#include "lf_common.h"

#ifdef LF_WITH_CUBLASLT
#include <cublasLt.h>
#endif

namespace loongforge {

#ifdef LF_WITH_CUBLASLT
namespace {

constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;  // cuBLAS's recommendation for Hopper

#define LF_LT_CHECK(expr)                                                                                 \
    do {                                                                                                  \
        const cublasStatus_t lf_status_ = (expr);                                                         \
        LF_CHECK(lf_status_ == CUBLAS_STATUS_SUCCESS, "expert_linear_backward: ", #expr, " failed: ",    \
                 cublasGetStatusString(lf_status_));                                                      \
    } while (0)

// cuBLASLt handles hold no stream (each matmul takes one): one per device for the process.
cublasLtHandle_t lt_handle(int device) {
    static std::mutex mu;
    static std::unordered_map<int, cublasLtHandle_t> handles;
    const std::lock_guard<std::mutex> lock(mu);
    auto it = handles.find(device);
    if (it != handles.end()) return it->second;
    cublasLtHandle_t handle;
    LF_LT_CHECK(cublasLtCreate(&handle));
    handles.emplace(device, handle);
    return handle;
}

cudaDataType_t lt_dtype(at::ScalarType t) {
    switch (t) {
        case at::kBFloat16: return CUDA_R_16BF;
        case at::kHalf: return CUDA_R_16F;
        case at::kFloat: return CUDA_R_32F;
        default: LF_CHECK(false, "expert_linear_backward: no cuBLASLt type for ", t);
    }
    return CUDA_R_32F;
}

// The row-count bucket: rounded up to a multiple of max(16, 2^(floor(log2 r) - 3)), i.e. 8 buckets an octave.
int64_t bucket(int64_t r) {
    int64_t step = 1;
    while (step * 16 <= r) step <<= 1;  // step = 2^(floor(log2 r) - 3) for r >= 16
    step = step < 16 ? 16 : step;
    return (r + step - 1) / step * step;
}

// The largest power of two (at most 256) dividing every pointer and leading dimension in bytes.
uint32_t alignment(std::initializer_list<uint64_t> values) {
    uint32_t align = 256;
    for (uint64_t v : values) {
        while (align > 1 && v % align) align >>= 1;
    }
    return align;
}

struct Problem {
    cublasOperation_t opb;
    int64_t m, n, k;
    int64_t ldb() const { return opb == CUBLAS_OP_N ? k : n; }
};

// device, dtype, opb, m, n, k (as asked), alignment, exact size (true) or the row count's bucket (false)
using Key = std::tuple<int, int, int, int64_t, int64_t, int64_t, uint32_t, bool>;
struct KeyHash {
    size_t operator()(const Key& key) const {
        size_t h = 0;
        auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
        mix(std::get<0>(key)), mix(std::get<1>(key)), mix(std::get<2>(key)), mix(std::get<3>(key));
        mix(std::get<4>(key)), mix(std::get<5>(key)), mix(std::get<6>(key)), mix(std::get<7>(key));
        return h;
    }
};
struct Choice {
    bool found = false;
    cublasLtMatmulAlgo_t algo{};
};

// The descriptors of one problem, destroyed with it.
struct Descriptors {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    Descriptors(const Problem& p, cudaDataType_t dtype) {
        LF_LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t opa = CUBLAS_OP_N;
        LF_LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
        LF_LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &p.opb, sizeof(p.opb)));
        LF_LT_CHECK(cublasLtMatrixLayoutCreate(&a, dtype, p.m, p.k, p.m));
        if (p.opb == CUBLAS_OP_N) {
            LF_LT_CHECK(cublasLtMatrixLayoutCreate(&b, dtype, p.k, p.n, p.k));
        } else {
            LF_LT_CHECK(cublasLtMatrixLayoutCreate(&b, dtype, p.n, p.k, p.n));
        }
        LF_LT_CHECK(cublasLtMatrixLayoutCreate(&c, dtype, p.m, p.n, p.m));
    }
    ~Descriptors() {
        if (c) cublasLtMatrixLayoutDestroy(c);
        if (b) cublasLtMatrixLayoutDestroy(b);
        if (a) cublasLtMatrixLayoutDestroy(a);
        if (op) cublasLtMatmulDescDestroy(op);
    }
    Descriptors(const Descriptors&) = delete;
    Descriptors& operator=(const Descriptors&) = delete;
};

Choice ask_heuristic(cublasLtHandle_t handle, const Problem& p, cudaDataType_t dtype, uint32_t align) {
    Descriptors d(p, dtype);
    cublasLtMatmulPreference_t pref;
    LF_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t workspace = kWorkspaceBytes;
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;  // split-K sums in fp32 only
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                         sizeof(workspace));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                         sizeof(reductions));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
        cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, pref, 1, &result, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    Choice choice;
    if (status == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
        choice.found = true;
        choice.algo = result.algo;
    }
    return choice;
}

std::mutex cache_mu;
std::unordered_map<Key, Choice, KeyHash> cache;

Choice cached_choice(cublasLtHandle_t handle, const Key& key, const Problem& asked, cudaDataType_t dtype,
                     uint32_t align) {
    {
        const std::lock_guard<std::mutex> lock(cache_mu);
        auto it = cache.find(key);
        if (it != cache.end()) return it->second;
    }
    const Choice choice = ask_heuristic(handle, asked, dtype, align);  // outside the lock: ~0.4 ms
    const std::lock_guard<std::mutex> lock(cache_mu);
    return cache.emplace(key, choice).first->second;
}

cublasStatus_t run(cublasLtHandle_t handle, const Problem& p, cudaDataType_t dtype, const Choice& choice,
                   const void* a_ptr, const void* b_ptr, void* c_ptr, void* workspace, cudaStream_t stream) {
    Descriptors d(p, dtype);
    const float one = 1.f, zero = 0.f;
    return cublasLtMatmul(handle, d.op, &one, a_ptr, d.a, b_ptr, d.b, &zero, c_ptr, d.c, c_ptr, d.c, &choice.algo,
                          workspace, kWorkspaceBytes, stream);
}

}  // namespace
#endif  // LF_WITH_CUBLASLT

const char* expert_gemm_backend_cuda() {
#ifdef LF_WITH_CUBLASLT
    return "cublaslt";
#else
    return "aten";  // built without cuBLASLt's header: torch's cuBLAS path (a heuristic query per new shape)
#endif
}

int64_t expert_gemm_workspace_bytes_cuda() {
#ifdef LF_WITH_CUBLASLT
    return kWorkspaceBytes;
#else
    return 0;
#endif
}

// wgrad = false: out[n, N] = a[n, K] @ b[K, N];  wgrad = true: out[M, N] = a[n, M]^T @ b[n, N].
// Every tensor contiguous, one dtype, one CUDA device; n >= 1; workspace: expert_gemm_workspace_bytes_cuda() bytes.
void expert_gemm_cuda(const at::Tensor& a, const at::Tensor& b, bool wgrad, const at::Tensor& out,
                      const at::Tensor& workspace) {
#ifdef LF_WITH_CUBLASLT
    const c10::cuda::CUDAGuard guard(a.device());
    const int device = a.get_device();
    const int64_t rows = a.size(0);
    const Problem p = wgrad ? Problem{CUBLAS_OP_T, b.size(1), a.size(1), rows} : Problem{CUBLAS_OP_N, b.size(1), rows, a.size(1)};
    Problem asked = p;
    (wgrad ? asked.k : asked.n) = bucket(rows);
    const cudaDataType_t dtype = lt_dtype(a.scalar_type());
    const uint64_t es = a.element_size();
    const uint32_t align = alignment({reinterpret_cast<uint64_t>(a.data_ptr()), reinterpret_cast<uint64_t>(b.data_ptr()),
                                      reinterpret_cast<uint64_t>(out.data_ptr()), p.m * es, p.ldb() * es});
    cublasLtHandle_t handle = lt_handle(device);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    const Key key{device, static_cast<int>(dtype), static_cast<int>(p.opb), asked.m, asked.n, asked.k, align, false};
    Choice choice = cached_choice(handle, key, asked, dtype, align);
    if (choice.found &&
        run(handle, p, dtype, choice, b.data_ptr(), a.data_ptr(), out.data_ptr(), workspace.data_ptr(), stream) ==
            CUBLAS_STATUS_SUCCESS) {
        return;
    }
    // the bucket's algorithm does not take this size: ask for the exact one (kept under its own key)
    const Key exact{device, static_cast<int>(dtype), static_cast<int>(p.opb), p.m, p.n, p.k, align, true};
    choice = cached_choice(handle, exact, p, dtype, align);
    if (choice.found &&
        run(handle, p, dtype, choice, b.data_ptr(), a.data_ptr(), out.data_ptr(), workspace.data_ptr(), stream) ==
            CUBLAS_STATUS_SUCCESS) {
        return;
    }
#endif
    (void)workspace;
    at::Tensor dst = out;
    at::mm_out(dst, wgrad ? a.t() : a, b);
}

}  // namespace loongforge
