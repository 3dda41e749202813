// cuBLAS and cuBLASLt, opened with dlopen when the first CUDA backend is made instead of linked.
//
// Linked, the two libraries load with every process built with CUDA, and libcublasLt's static
// initialisers write about 92 MiB of tables into each, GPU or not, in some 100 ms: every CPU
// worker, the coordinator, the CLI and each test program paid that for calls they never make.
// Opened here, only a process that makes a CudaBackend pays it (MakeCudaBackend calls LoadCublas).
//
// Every cuBLAS and cuBLASLt entry point kernels/cuda/ calls is a member of CublasApi, typed from
// the library's own header, so a call through the table is checked by the compiler as a direct
// call is. A new entry point goes here (the member and its symbol in cublas_api.cc), not as a
// direct call, which would no longer link.
#ifndef SHARDSERVE_KERNELS_CUDA_CUBLAS_API_H_
#define SHARDSERVE_KERNELS_CUDA_CUBLAS_API_H_

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

#include "absl/status/statusor.h"

namespace shardserve::cuda {

struct CublasApi {
  // cuBLAS (libcublas).
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  // cublasGemmEx with a cublasComputeType_t (cublas_api.h also declares an inline overload taking a
  // cudaDataType, which has no symbol).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  // cuBLASLt (libcublasLt): the fp8 GEMM (fp8_gemm.cu).
  decltype(&cublasLtCreate) lt_create = nullptr;
  decltype(&cublasLtDestroy) lt_destroy = nullptr;
  decltype(&cublasLtMatmul) lt_matmul = nullptr;
  decltype(&cublasLtMatmulDescCreate) lt_matmul_desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) lt_matmul_desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) lt_matmul_desc_set_attribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) lt_matrix_layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) lt_matrix_layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) lt_matmul_preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) lt_matmul_preference_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) lt_matmul_preference_set_attribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) lt_matmul_algo_get_heuristic = nullptr;
};

// The file names tried for each library: the soname of the major version this build's headers
// declare (libcublas.so.13), found through the loader's search path (LD_LIBRARY_PATH, the
// programs' RUNPATH, ld.so.cache), then the same name in the CUDA toolkit's library directory this
// build was configured with.
std::string CublasLibraryPath(bool lt, bool in_toolkit_dir);

// Opens both libraries and finds every entry point, once per process (thread-safe); later calls
// return the same table, or the same error: FailedPrecondition naming the library that could not be
// opened (with dlerror's reason) or the symbol it lacks. The table lives until the process exits.
absl::StatusOr<const CublasApi*> LoadCublas();

// The table once LoadCublas() has succeeded in this process, else nullptr.
const CublasApi* LoadedCublas();

}  // namespace shardserve::cuda

#endif  // SHARDSERVE_KERNELS_CUDA_CUBLAS_API_H_
