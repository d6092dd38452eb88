// run_wgrad with the Pong128x128 tile configuration (one instantiation per file: ninja compiles them in parallel)
#include "grouped_gemm_kernel.cuh"

LF_GROUPED_GEMM_INSTANCE(run_wgrad, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, 2, Pong128x128)
