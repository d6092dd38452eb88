// The MoE experts' backward on CUDA, one GEMM per expert and product (the binding's expert_linear_bwd checks and
// allocates), through cuBLASLt with the algorithm of each problem class chosen once per process.
//
// Why not torch.mm per expert: with fresh routing every step, an expert's row count is new almost every call, and
// cuBLAS then runs its heuristic again. On the H200 that cost ~380 us of host time a GEMM with fresh group sizes
// against ~23 us with repeated ones (benchmarks/diagnose_grouped_gemm --host-cost, a811de5), far more than the
// per-expert GEMMs save on the device. Here the heuristic is asked once per (dtype, layout, fixed sizes, alignment,
// bucket of the row count): by default the row count rounded up to 8 steps an octave (at least 16 rows a step);
// the caller may ask for multiples of a fixed step or for exact sizes (row_bucket, see bucket()), which
// diagnose_grouped_gemm --policies compares on the device. The algorithm found for the bucket's upper end then runs
// the actual size; where cuBLASLt refuses it, the exact size is asked for (and kept), and where no algorithm exists
// at all, at::mm_out runs the product.
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
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "lf_common.h"
#include "moe_expert_gemm_aten.h"

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

constexpr int64_t kExactRows = -1, kBlockRows = -2;  // row_bucket codes besides 0 (octave) and steps > 0

// 2^(floor(log2 r) - 3), at least 16: the width of an octave bucket at r
int64_t octave_step(int64_t r) {
    int64_t step = 1;
    while (step * 16 <= r) step <<= 1;
    return step < 16 ? 16 : step;
}

// The row count the heuristic is asked for. row_bucket 0: rounded up to a multiple of octave_step(r), i.e. 8
// buckets an octave; > 0: rounded up to a multiple of row_bucket; -1: the exact count; -2 (blocks): the exact
// count for multiples of 8, else the last count of r's block of 8 (r | 7). On the H200 (cuBLAS of CUDA 13.0,
// diagnose_grouped_gemm --algo-map at fda3a08) the exact choice over row counts 1024..6144 of the e2e mixtral and
// mixtral_like backward products was a function of exactly that: within a block of 8, the 7 counts that are not a
// multiple of 8 share one algorithm, and a multiple of 8 often takes another (an aligned tile), so a bucket's upper
// end, always a multiple of 16, picked the algorithm of the actual count for only 5-15% of the input-gradient
// products' counts and ran the rest 2-5% slower. Blocks give the exact choice for every count, deterministic (a
// function of the count alone), at a heuristic query (~0.1 ms of host time) per block and multiple of 8 the first
// time one is seen. The wider map at 6fcfdb4 (rows 1..12288, all three shapes) agreed for every count but one:
// a single row, whose weight-gradient product (k = 1) takes an algorithm of its own, so 1 is asked as itself.
int64_t bucket(int64_t r, int64_t row_bucket) {
    if (row_bucket == kExactRows) return r;
    if (row_bucket == kBlockRows) return r % 8 == 0 || r == 1 ? r : (r | 7);
    if (row_bucket > 0) return (r + row_bucket - 1) / row_bucket * row_bucket;
    const int64_t step = octave_step(r);
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
// What identifies an algorithm across problem sizes: cuBLASLt's configuration attributes (algorithm id, tile,
// split-K count, reduction, CTA swizzle, custom option, stages, inner shape, cluster shape), for expert_gemm_heuristic.
std::vector<int64_t> config_of(const cublasLtMatmulAlgo_t& algo) {
    constexpr cublasLtMatmulAlgoConfigAttributes_t attrs[] = {
        CUBLASLT_ALGO_CONFIG_ID,         CUBLASLT_ALGO_CONFIG_TILE_ID,          CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
        CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
        CUBLASLT_ALGO_CONFIG_STAGES_ID,  CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID,  CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
    std::vector<int64_t> config;
    for (auto attr : attrs) {
        // each attribute is read at its own width (16 or 32 bits), into the low bytes of value (little-endian)
        size_t needed = 0, written = 0;
        uint64_t value = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &needed);
        if (needed > 0 && needed <= sizeof(value)) {
            cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, needed, &written);
        }
        config.push_back(static_cast<int64_t>(value));
    }
    return config;
}

struct Choice {
    bool found = false;
    cublasLtMatmulAlgo_t algo{};
};

// Heuristic queries and their host time (expert_gemm_stats)
std::atomic<int64_t> n_queries{0}, n_query_ns{0};

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
    const auto t0 = std::chrono::steady_clock::now();
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, d.op, d.a, d.b, d.c, d.c, pref, 1, &result, &returned);
    n_query_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    ++n_queries;
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

// The descriptors of one product class, made once per call of expert_linear_bwd_cuda; each expert's GEMM sets
// only its row count on them (two layout attributes) instead of making and destroying four descriptors.
struct Reused {
    Problem p;
    Descriptors d;
    Reused(const Problem& problem, cudaDataType_t dtype) : p(problem), d(problem, dtype) {}
    void set_rows(bool wgrad, int64_t rows) {
        const uint64_t r = static_cast<uint64_t>(rows);
        if (wgrad) {  // cuBLAS's k: A is m x k, B (op T) n x k with ld n
            p.k = rows;
            LF_LT_CHECK(cublasLtMatrixLayoutSetAttribute(d.a, CUBLASLT_MATRIX_LAYOUT_COLS, &r, sizeof(r)));
            LF_LT_CHECK(cublasLtMatrixLayoutSetAttribute(d.b, CUBLASLT_MATRIX_LAYOUT_COLS, &r, sizeof(r)));
        } else {  // cuBLAS's n: B (op N) k x n with ld k, C m x n
            p.n = rows;
            LF_LT_CHECK(cublasLtMatrixLayoutSetAttribute(d.b, CUBLASLT_MATRIX_LAYOUT_COLS, &r, sizeof(r)));
            LF_LT_CHECK(cublasLtMatrixLayoutSetAttribute(d.c, CUBLASLT_MATRIX_LAYOUT_COLS, &r, sizeof(r)));
        }
    }
};

// One expert's product on raw pointers: A = b, B = a (see the top); false where cuBLASLt has no algorithm for it.
bool lt_gemm(cublasLtHandle_t handle, Reused& r, bool wgrad, int64_t rows, int64_t row_bucket, cudaDataType_t dtype,
             int device, uint64_t es, const void* a_ptr, const void* b_ptr, void* c_ptr, void* workspace,
             cudaStream_t stream) {
    r.set_rows(wgrad, rows);
    const Problem& p = r.p;
    const uint32_t align = alignment({reinterpret_cast<uint64_t>(a_ptr), reinterpret_cast<uint64_t>(b_ptr),
                                      reinterpret_cast<uint64_t>(c_ptr), p.m * es, p.ldb() * es});
    const float one = 1.f, zero = 0.f;
    auto run = [&](const Choice& choice) {
        return choice.found && cublasLtMatmul(handle, r.d.op, &one, b_ptr, r.d.a, a_ptr, r.d.b, &zero, c_ptr, r.d.c,
                                              c_ptr, r.d.c, &choice.algo, workspace, kWorkspaceBytes,
                                              stream) == CUBLAS_STATUS_SUCCESS;
    };
    Problem asked = p;
    (wgrad ? asked.k : asked.n) = bucket(rows, row_bucket);
    const Key key{device, static_cast<int>(dtype), static_cast<int>(p.opb), asked.m, asked.n, asked.k, align, false};
    if (run(cached_choice(handle, key, asked, dtype, align))) return true;
    // the bucket's algorithm does not take this size: ask for the exact one (kept under its own key)
    const Key exact{device, static_cast<int>(dtype), static_cast<int>(p.opb), p.m, p.n, p.k, align, true};
    return run(cached_choice(handle, exact, p, dtype, align));
}

}  // namespace
#endif  // LF_WITH_CUBLASLT

// Counters since the process started: cuBLASLt heuristic queries and their host nanoseconds.
std::vector<int64_t> expert_gemm_stats_cuda() {
#ifdef LF_WITH_CUBLASLT
    return {n_queries.load(), n_query_ns.load()};
#else
    return {0, 0};
#endif
}

// The exact heuristic's algorithm (its configuration attributes, see config_of; empty where it has none) for one
// product of like's dtype on like's device: "rows" (wgrad false: m x rows x k = fixed) or "wgrad" (m x n = fixed,
// k = rows), operands 256-byte aligned. Not cached: for mapping the heuristic's choices over row counts.
std::vector<int64_t> expert_gemm_heuristic_cuda(const at::Tensor& like, bool wgrad, int64_t m, int64_t fixed,
                                                int64_t rows) {
#ifdef LF_WITH_CUBLASLT
    const c10::cuda::CUDAGuard guard(like.device());
    const Problem p = wgrad ? Problem{CUBLAS_OP_T, m, fixed, rows} : Problem{CUBLAS_OP_N, m, rows, fixed};
    const Choice choice = ask_heuristic(lt_handle(like.get_device()), p, lt_dtype(like.scalar_type()), 256);
    return choice.found ? config_of(choice.algo) : std::vector<int64_t>{};
#else
    return {};
#endif
}

const char* expert_gemm_backend_cuda() {
#ifdef LF_WITH_CUBLASLT
    return "cublaslt";
#else
    return "aten";  // built without cuBLASLt's header: torch's cuBLAS path (a heuristic query per new shape)
#endif
}

// The experts' backward of y_PO = x_PI @ w_EOI[e]^T (see the binding's expert_linear_bwd): for each expert e with
// n > 0 rows from row s,  dx_PI[s:s+n] = dy_PO[s:s+n] @ w_EOI[e]  and  dw_EOI[e] = dy_PO[s:s+n]^T @ x_PI[s:s+n];
// dw_EOI[e] = 0 for an expert without rows. dx_PI / dw_EOI undefined: not computed. Arguments checked by the
// binding (contiguous, one dtype, one CUDA device, counts summing to P). The loop is here, on raw pointers, so
// that a GEMM costs the host little more than its cublasLtMatmul (no tensor views, one guard, handle, stream and
// workspace for all of them).
void expert_linear_bwd_cuda(const at::Tensor& dy_PO, const at::Tensor& x_PI, const at::Tensor& w_EOI,
                            const std::vector<int64_t>& counts, int64_t row_bucket, const at::Tensor& dx_PI,
                            const at::Tensor& dw_EOI) {
    const c10::cuda::CUDAGuard guard(x_PI.device());
    const bool need_dx = dx_PI.defined(), need_dw = dw_EOI.defined();
    const int64_t O = dy_PO.size(1), I = x_PI.size(1);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x_PI.get_device()).stream();
    const uint64_t es = x_PI.element_size();
    char* dw = need_dw ? static_cast<char*>(dw_EOI.data_ptr()) : nullptr;
#ifdef LF_WITH_CUBLASLT
    const int device = x_PI.get_device();
    const cudaDataType_t dtype = lt_dtype(x_PI.scalar_type());
    cublasLtHandle_t handle = lt_handle(device);
    const at::Tensor workspace = at::empty({kWorkspaceBytes}, x_PI.options().dtype(at::kByte));
    // rows (dx): m = I, n = rows, k = O;  wgrad (dw): m = I, n = O, k = rows. The row count is set per expert.
    Reused rows_gemm(Problem{CUBLAS_OP_N, I, 1, O}, dtype), wgrad_gemm(Problem{CUBLAS_OP_T, I, O, 1}, dtype);
    const char* dy = static_cast<const char*>(dy_PO.data_ptr());
    const char* x = static_cast<const char*>(x_PI.data_ptr());
    const char* w = static_cast<const char*>(w_EOI.data_ptr());
    char* dx = need_dx ? static_cast<char*>(dx_PI.data_ptr()) : nullptr;
#endif
    int64_t start = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
        const int64_t n = counts[e];
        if (n == 0) {
            if (need_dw) C10_CUDA_CHECK(cudaMemsetAsync(dw + e * O * I * es, 0, O * I * es, stream));
            continue;
        }
        bool dx_done = !need_dx, dw_done = !need_dw;
#ifdef LF_WITH_CUBLASLT
        if (need_dx) {
            dx_done = lt_gemm(handle, rows_gemm, false, n, row_bucket, dtype, device, es, dy + start * O * es,
                              w + e * O * I * es, dx + start * I * es, workspace.data_ptr(), stream);
        }
        if (need_dw) {
            dw_done = lt_gemm(handle, wgrad_gemm, true, n, row_bucket, dtype, device, es, dy + start * O * es,
                              x + start * I * es, dw + e * O * I * es, workspace.data_ptr(), stream);
        }
#endif
        if (!dx_done || !dw_done) {  // no cuBLASLt algorithm (or none built in): ATen's cuBLAS product
            expert_backward_aten(dy_PO, x_PI, w_EOI, e, start, n, dx_PI, dw_EOI, !dx_done, !dw_done);
        }
        start += n;
    }
}

}  // namespace loongforge
