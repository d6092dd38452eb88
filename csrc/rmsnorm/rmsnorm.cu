// Fused RMSNorm (optionally with the residual add in front) on CUDA.
//
//   h = x + residual (rounded to the activation dtype, as an unfused add would store it)
//   y = h * rstd * w,  rstd = 1 / sqrt(mean(h^2) + eps)            (fp32 arithmetic, one rounding)
//   backward: xhat = h * rstd, g = w * dy
//             dx = rstd * (g - xhat * mean(xhat * g)) [+ d(h_out)],  dw = sum_rows(dy * xhat)
//
// Layout: rows of `hidden` elements; inputs may have a row stride, elements in a row are adjacent.
// Preconditions of the register path: hidden % V == 0, every row start 16-byte aligned; each thread
// keeps VPT vectors of its row in registers, so the row is read from memory once per pass. Otherwise
// (odd or very large hidden sizes) the streaming path re-reads the row, which stays in L1/L2.
// dw is reduced deterministically: per-(block,row-slot) fp32 partials, then a column reduction.
#include "lf_cuda_utils.cuh"

namespace loongforge {
namespace {

constexpr int kRowsSmem = 8 * 32;  // 32 floats per row slot; row slots per block <= 8 when tpr >= 32

template <int VPT>
constexpr int max_threads_for_vpt() {
    return VPT <= 2 ? 1024 : (VPT == 4 ? 512 : 256);
}

template <typename T, typename W, int V, int VPT, bool RES>
__global__ void __launch_bounds__(max_threads_for_vpt<VPT>())
    rmsnorm_fwd_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ res,
                       int64_t res_stride, const W* __restrict__ w, T* __restrict__ y,
                       T* __restrict__ h_out, float* __restrict__ rstd_out, int64_t rows, int hidden,
                       float eps) {
    __shared__ float smem[kRowsSmem];
    const int tpr = blockDim.x;
    const int n_vec = hidden / V;
    const float inv_hidden = 1.f / static_cast<float>(hidden);
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows;
         base += static_cast<int64_t>(gridDim.x) * blockDim.y) {
        const int64_t row = base + threadIdx.y;
        const bool valid = row < rows;
        float vals[VPT][V];
        float sumsq = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = threadIdx.x + k * tpr;
            if (valid && c < n_vec) {
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
                    vals[k][j] = static_cast<float>(xv.val[j]);
                    sumsq += vals[k][j] * vals[k][j];
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
                for (int j = 0; j < V; ++j) {
                    yv.val[j] = static_cast<T>(vals[k][j] * rstd * static_cast<float>(wv.val[j]));
                }
                store_vec<T, V>(y + row * hidden + c * V, yv);
            }
        }
    }
}

template <typename T, typename W, int V, int VPT, bool DRES>
__global__ void __launch_bounds__(max_threads_for_vpt<VPT>())
    rmsnorm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ h, int64_t h_stride,
                       const float* __restrict__ rstd_in, const W* __restrict__ w,
                       const T* __restrict__ dres, T* __restrict__ dx,
                       float* __restrict__ dw_partial, int64_t rows, int hidden) {
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
        float xhat[VPT][V];
        float g[VPT][V];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = threadIdx.x + k * tpr;
            if (valid && c < n_vec) {
                const Vec<T, V> hv = load_vec<T, V>(h + row * h_stride + c * V);
                const Vec<T, V> dv = load_vec<T, V>(dy + row * hidden + c * V);
                const Vec<W, V> wv = load_vec<W, V>(w + c * V);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float d = static_cast<float>(dv.val[j]);
                    xhat[k][j] = static_cast<float>(hv.val[j]) * rstd;
                    g[k][j] = d * static_cast<float>(wv.val[j]);
                    dot += xhat[k][j] * g[k][j];
                    acc[k][j] += d * xhat[k][j];
                }
            }
        }
        dot = row_allreduce_sum(dot, smem, tpr) * inv_hidden;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = threadIdx.x + k * tpr;
            if (valid && c < n_vec) {
                Vec<T, V> out;
                if constexpr (DRES) {
                    const Vec<T, V> rv = load_vec<T, V>(dres + row * hidden + c * V);
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                        out.val[j] = static_cast<T>(rstd * (g[k][j] - xhat[k][j] * dot) +
                                                    static_cast<float>(rv.val[j]));
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                        out.val[j] = static_cast<T>(rstd * (g[k][j] - xhat[k][j] * dot));
                    }
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
                                 float eps) {
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
                yv.val[j] = static_cast<T>(static_cast<float>(hv.val[j]) * rstd *
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
                                 int hidden) {
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
                dot += static_cast<float>(hv.val[j]) * rstd * static_cast<float>(dv.val[j]) *
                       static_cast<float>(wv.val[j]);
            }
        }
        dot = row_allreduce_sum(dot, smem, blockDim.x) / static_cast<float>(hidden);
        for (int c = threadIdx.x; c < n_vec; c += blockDim.x) {
            const Vec<T, V> hv = load_vec<T, V>(h + row * h_stride + c * V);
            const Vec<T, V> dv = load_vec<T, V>(dy + row * hidden + c * V);
            const Vec<W, V> wv = load_vec<W, V>(w + c * V);
            Vec<T, V> out;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                const float xhat = static_cast<float>(hv.val[j]) * rstd;
                const float d = static_cast<float>(dv.val[j]);
                float v = rstd * (d * static_cast<float>(wv.val[j]) - xhat * dot);
                if constexpr (DRES) v += static_cast<float>(dres[row * hidden + c * V + j]);
                out.val[j] = static_cast<T>(v);
                my_partial[c * V + j] += d * xhat;
            }
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
        const int vpts[4] = {1, 2, 4, 8};
        const int caps[4] = {1024, 1024, 512, 256};
        // Prefer <= 256 threads per row (several blocks per SM); else the most a VPT allows.
        for (int pass = 0; pass < 2 && plan.vpt == 0; ++pass) {
            for (int i = 0; i < 4; ++i) {
                const int threads = (n_vec + vpts[i] - 1) / vpts[i];
                if (threads <= (pass == 0 ? 256 : caps[i])) {
                    plan.vpt = vpts[i];
                    plan.tpr = threads < 32 ? next_pow2(threads) : (threads + 31) / 32 * 32;
                    break;
                }
            }
        }
        if (plan.vpt > 0) {
            plan.rows_per_block = plan.tpr >= 256 ? 1 : 256 / plan.tpr;
            return plan;
        }
    }
    const int n_vec = hidden / plan.vec;
    plan.tpr = std::min(1024, (n_vec + 31) / 32 * 32);
    return plan;
}

template <typename T>
void dispatch_weight(const at::Tensor& weight, const char* name, const auto& fn) {
    if (weight.scalar_type() == c10::CppTypeToScalarType<T>::value) {
        fn.template operator()<T>();
    } else if (weight.scalar_type() == at::kFloat) {
        fn.template operator()<float>();
    } else {
        TORCH_CHECK(false, name, ": weight dtype must equal the input dtype or be float32, got weight ",
                    weight.scalar_type(), " for input ", c10::CppTypeToScalarType<T>::value);
    }
}

template <int V>
void dispatch_vpt(int vpt, const auto& fn) {
    switch (vpt) {
        case 1: fn.template operator()<V, 1>(); break;
        case 2: fn.template operator()<V, 2>(); break;
        case 4: fn.template operator()<V, 4>(); break;
        case 8: fn.template operator()<V, 8>(); break;
        default: TORCH_CHECK(false, "rmsnorm: internal error, unexpected vectors per thread ", vpt);
    }
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight) {
    LF_CHECK_CUDA(x);
    LF_CHECK_CUDA(weight);
    LF_CHECK_ROWS(x);
    LF_CHECK_FLOATING(x);
    LF_CHECK_DIM(weight, 1);
    LF_CHECK_CONTIGUOUS(weight);
    TORCH_CHECK(weight.size(0) == x.size(1), "rmsnorm: weight has ", weight.size(0),
                " elements but the input rows have ", x.size(1),
                "; the weight must match the hidden size");
    TORCH_CHECK(x.size(1) > 0 && x.size(1) <= std::numeric_limits<int>::max() / 2,
                "rmsnorm: hidden size must be in [1, 2^30), got ", x.size(1));
    TORCH_CHECK(x.get_device() == weight.get_device(), "rmsnorm: input on ", x.device(),
                " but weight on ", weight.device());
}

}  // namespace

std::vector<at::Tensor> rmsnorm_fwd_cuda(const at::Tensor& x,
                                         const c10::optional<at::Tensor>& residual,
                                         const at::Tensor& weight, double eps) {
    check_inputs(x, weight);
    const bool has_res = residual.has_value() && residual->defined();
    if (has_res) {
        LF_CHECK_CUDA(*residual);
        LF_CHECK_ROWS(*residual);
        TORCH_CHECK(residual->sizes() == x.sizes(), "rmsnorm: residual shape ", residual->sizes(),
                    " differs from input shape ", x.sizes());
        TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "rmsnorm: residual dtype ",
                    residual->scalar_type(), " differs from input dtype ", x.scalar_type());
    }
    TORCH_CHECK(eps >= 0, "rmsnorm: eps must be >= 0, got ", eps);
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0);
    const int hidden = static_cast<int>(x.size(1));
    auto y = at::empty({rows, hidden}, x.options());
    auto h_out = has_res ? at::empty({rows, hidden}, x.options()) : at::Tensor();
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    if (rows == 0) return {y, h_out, rstd};

    const int elem = x.element_size();
    bool aligned = lf_aligned16(x.data_ptr()) && (x.stride(0) * elem) % 16 == 0 &&
                   lf_aligned16(weight.data_ptr());
    if (has_res) {
        aligned = aligned && lf_aligned16(residual->data_ptr()) &&
                  (residual->stride(0) * elem) % 16 == 0;
    }
    const RowPlan plan = plan_rows(hidden, elem, aligned);
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t max_grid = static_cast<int64_t>(lf_sm_count()) * 64;

    LF_DISPATCH_FLOATING(x.scalar_type(), "rmsnorm_fwd", [&] {
        using T = scalar_t;
        dispatch_weight<T>(weight, "rmsnorm_fwd", [&]<typename W>() {
            const T* xp = x.data_ptr<T>();
            const T* rp = has_res ? residual->data_ptr<T>() : nullptr;
            const int64_t rs = has_res ? residual->stride(0) : 0;
            const W* wp = weight.data_ptr<W>();
            T* hp = has_res ? h_out.data_ptr<T>() : nullptr;
            const float feps = static_cast<float>(eps);
            if (plan.vpt > 0) {
                const dim3 block(plan.tpr, plan.rows_per_block);
                const int64_t blocks = std::min(
                    max_grid, (rows + plan.rows_per_block - 1) / plan.rows_per_block);
                constexpr int VF = 16 / sizeof(T);
                dispatch_vpt<VF>(plan.vpt, [&]<int V, int VPT>() {
                    if (has_res) {
                        rmsnorm_fwd_kernel<T, W, V, VPT, true><<<blocks, block, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps);
                    } else {
                        rmsnorm_fwd_kernel<T, W, V, VPT, false><<<blocks, block, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps);
                    }
                });
            } else {
                const int64_t blocks = std::min(max_grid, rows);
                auto launch = [&]<int V>() {
                    if (has_res) {
                        rmsnorm_fwd_streaming_kernel<T, W, V, true><<<blocks, plan.tpr, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps);
                    } else {
                        rmsnorm_fwd_streaming_kernel<T, W, V, false><<<blocks, plan.tpr, 0, stream>>>(
                            xp, x.stride(0), rp, rs, wp, y.data_ptr<T>(), hp,
                            rstd.data_ptr<float>(), rows, hidden, feps);
                    }
                };
                if (plan.vec == 1) launch.template operator()<1>();
                else launch.template operator()<16 / sizeof(T)>();
            }
            LF_CUDA_CHECK_LAUNCH();
        });
    });
    return {y, h_out, rstd};
}

std::vector<at::Tensor> rmsnorm_bwd_cuda(const at::Tensor& dy, const at::Tensor& h,
                                         const at::Tensor& rstd, const at::Tensor& weight,
                                         const c10::optional<at::Tensor>& dresidual) {
    check_inputs(h, weight);
    LF_CHECK_CUDA(dy);
    LF_CHECK_CONTIGUOUS(dy);
    TORCH_CHECK(dy.sizes() == h.sizes(), "rmsnorm_bwd: grad shape ", dy.sizes(),
                " differs from input shape ", h.sizes());
    TORCH_CHECK(dy.scalar_type() == h.scalar_type(), "rmsnorm_bwd: grad dtype ", dy.scalar_type(),
                " differs from input dtype ", h.scalar_type());
    LF_CHECK_CUDA(rstd);
    LF_CHECK_DTYPE(rstd, at::kFloat);
    LF_CHECK_SHAPE(rstd, h.size(0));
    const bool has_dres = dresidual.has_value() && dresidual->defined();
    if (has_dres) {
        LF_CHECK_CUDA(*dresidual);
        LF_CHECK_CONTIGUOUS(*dresidual);
        TORCH_CHECK(dresidual->sizes() == h.sizes() && dresidual->scalar_type() == h.scalar_type(),
                    "rmsnorm_bwd: residual grad must match the input, got ", dresidual->sizes(), " ",
                    dresidual->scalar_type());
    }
    const c10::cuda::CUDAGuard guard(h.device());
    const int64_t rows = h.size(0);
    const int hidden = static_cast<int>(h.size(1));
    auto dx = at::empty({rows, hidden}, h.options());
    if (rows == 0) return {dx, at::zeros_like(weight)};

    const int elem = h.element_size();
    const bool aligned = lf_aligned16(h.data_ptr()) && (h.stride(0) * elem) % 16 == 0 &&
                         lf_aligned16(dy.data_ptr()) && lf_aligned16(weight.data_ptr()) &&
                         (!has_dres || lf_aligned16(dresidual->data_ptr()));
    const RowPlan plan = plan_rows(hidden, elem, aligned);
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int sms = lf_sm_count();
    auto dw = at::empty_like(weight);
    at::Tensor partial;

    LF_DISPATCH_FLOATING(h.scalar_type(), "rmsnorm_bwd", [&] {
        using T = scalar_t;
        dispatch_weight<T>(weight, "rmsnorm_bwd", [&]<typename W>() {
            const T* dyp = dy.data_ptr<T>();
            const T* hp = h.data_ptr<T>();
            const T* drp = has_dres ? dresidual->data_ptr<T>() : nullptr;
            const W* wp = weight.data_ptr<W>();
            // Persistent grid: as many blocks as fit at once, so dw partials stay few.
            auto blocks_for = [&](auto kernel, int threads, int64_t work_items) {
                int per_sm = 0;
                C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                             threads, 0));
                return std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(per_sm) * sms,
                                                              work_items));
            };
            if (plan.vpt > 0) {
                const dim3 block(plan.tpr, plan.rows_per_block);
                const int64_t row_groups = (rows + plan.rows_per_block - 1) / plan.rows_per_block;
                constexpr int VF = 16 / sizeof(T);
                dispatch_vpt<VF>(plan.vpt, [&]<int V, int VPT>() {
                    auto run = [&](auto kernel) {
                        const int64_t blocks =
                            blocks_for(kernel, plan.tpr * plan.rows_per_block, row_groups);
                        partial = at::empty({blocks * plan.rows_per_block, hidden},
                                            h.options().dtype(at::kFloat));
                        kernel<<<blocks, block, 0, stream>>>(dyp, hp, h.stride(0),
                                                             rstd.data_ptr<float>(), wp, drp,
                                                             dx.data_ptr<T>(),
                                                             partial.data_ptr<float>(), rows,
                                                             hidden);
                    };
                    if (has_dres) run(rmsnorm_bwd_kernel<T, W, V, VPT, true>);
                    else run(rmsnorm_bwd_kernel<T, W, V, VPT, false>);
                });
            } else {
                auto launch = [&]<int V>() {
                    auto run = [&](auto kernel) {
                        const int64_t blocks = blocks_for(kernel, plan.tpr, rows);
                        partial = at::zeros({blocks, hidden}, h.options().dtype(at::kFloat));
                        kernel<<<blocks, plan.tpr, 0, stream>>>(dyp, hp, h.stride(0),
                                                                rstd.data_ptr<float>(), wp, drp,
                                                                dx.data_ptr<T>(),
                                                                partial.data_ptr<float>(), rows,
                                                                hidden);
                    };
                    if (has_dres) run(rmsnorm_bwd_streaming_kernel<T, W, V, true>);
                    else run(rmsnorm_bwd_streaming_kernel<T, W, V, false>);
                };
                if (plan.vec == 1) launch.template operator()<1>();
                else launch.template operator()<16 / sizeof(T)>();
            }
            LF_CUDA_CHECK_LAUNCH();
            const dim3 rblock(32, 16);
            rmsnorm_dw_reduce_kernel<W><<<(hidden + 31) / 32, rblock, 0, stream>>>(
                partial.data_ptr<float>(), partial.size(0), hidden, dw.data_ptr<W>());
            LF_CUDA_CHECK_LAUNCH();
        });
    });
    return {dx, dw};
}

}  // namespace loongforge
