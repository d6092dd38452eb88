// run_rows_bkn with the Coop256x128 tile configuration (one instantiation per file: ninja compiles them in parallel)
#include "grouped_gemm_kernel.cuh"

LF_GROUPED_GEMM_INSTANCE(run_rows_bkn, cutlass::layout::RowMajor, cutlass::layout::RowMajor, 1, Coop256x128)
