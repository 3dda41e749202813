// cuBLAS and cuBLASLt opened at run time (cublas_api.h).
#include "kernels/cuda/cublas_api.h"

#include <dlfcn.h>

#include <atomic>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#ifndef SHARDSERVE_CUDA_LIBRARY_DIR
#error "SHARDSERVE_CUDA_LIBRARY_DIR (the CUDA toolkit's library directory) is set by kernels/CMakeLists.txt"
#endif

namespace shardserve::cuda {
namespace {

// gemm_ex's type is spelled out; this keeps it the header's own: the cast compiles only where
// cublasGemmEx has an overload of exactly that type (unevaluated, so no symbol is needed).
static_assert(std::is_same_v<decltype(static_cast<decltype(CublasApi::gemm_ex)>(&cublasGemmEx)),
                             decltype(CublasApi::gemm_ex)>);

// dlerror's message for the last failed call, or `fallback` where it has none.
std::string DlError(const char* fallback) {
  const char* e = dlerror();
  return e != nullptr ? e : fallback;
}

// Opens `lt` (libcublasLt) or libcublas: by soname, then in the toolkit's directory.
absl::StatusOr<void*> Open(bool lt) {
  const std::string by_name = CublasLibraryPath(lt, false);
  void* handle = dlopen(by_name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle != nullptr) return handle;
  const std::string first_error = DlError("not found");
  const std::string in_dir = CublasLibraryPath(lt, true);
  handle = dlopen(in_dir.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle != nullptr) return handle;
  return absl::FailedPreconditionError(absl::StrCat("cannot open ", by_name, " (", first_error, ") or ", in_dir, " (",
                                                    DlError("not found"),
                                                    "): the CUDA backend needs cuBLAS from CUDA ", CUBLAS_VER_MAJOR,
                                                    "; put its directory on LD_LIBRARY_PATH"));
}

// Sets `fn` to `symbol` of `library` (opened from `path`).
template <typename Fn>
absl::Status Find(void* library, const std::string& path, const char* symbol, Fn& fn) {
  (void)dlerror();
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " has no ", symbol, " (", DlError("null"), "): the CUDA backend needs cuBLAS from CUDA ",
                     CUBLAS_VER_MAJOR, ".", CUBLAS_VER_MINOR, " or newer"));
  }
  fn = reinterpret_cast<Fn>(address);
  return absl::OkStatus();
}

absl::StatusOr<CublasApi> Load() {
  absl::StatusOr<void*> lt = Open(true);
  if (!lt.ok()) return lt.status();
  absl::StatusOr<void*> blas = Open(false);
  if (!blas.ok()) return blas.status();
  const std::string lt_path = CublasLibraryPath(true, false);
  const std::string blas_path = CublasLibraryPath(false, false);
  CublasApi api;
  for (absl::Status s : {
           Find(*blas, blas_path, "cublasCreate_v2", api.create),
           Find(*blas, blas_path, "cublasDestroy_v2", api.destroy),
           Find(*blas, blas_path, "cublasSetStream_v2", api.set_stream),
           Find(*blas, blas_path, "cublasSetMathMode", api.set_math_mode),
           Find(*blas, blas_path, "cublasGemmEx", api.gemm_ex),
           Find(*blas, blas_path, "cublasGetStatusName", api.status_name),
           Find(*blas, blas_path, "cublasGetStatusString", api.status_string),
           Find(*lt, lt_path, "cublasLtCreate", api.lt_create),
           Find(*lt, lt_path, "cublasLtDestroy", api.lt_destroy),
           Find(*lt, lt_path, "cublasLtMatmul", api.lt_matmul),
           Find(*lt, lt_path, "cublasLtMatmulDescCreate", api.lt_matmul_desc_create),
           Find(*lt, lt_path, "cublasLtMatmulDescDestroy", api.lt_matmul_desc_destroy),
           Find(*lt, lt_path, "cublasLtMatmulDescSetAttribute", api.lt_matmul_desc_set_attribute),
           Find(*lt, lt_path, "cublasLtMatrixLayoutCreate", api.lt_matrix_layout_create),
           Find(*lt, lt_path, "cublasLtMatrixLayoutDestroy", api.lt_matrix_layout_destroy),
           Find(*lt, lt_path, "cublasLtMatmulPreferenceCreate", api.lt_matmul_preference_create),
           Find(*lt, lt_path, "cublasLtMatmulPreferenceDestroy", api.lt_matmul_preference_destroy),
           Find(*lt, lt_path, "cublasLtMatmulPreferenceSetAttribute", api.lt_matmul_preference_set_attribute),
           Find(*lt, lt_path, "cublasLtMatmulAlgoGetHeuristic", api.lt_matmul_algo_get_heuristic),
       }) {
    if (!s.ok()) return s;
  }
  return api;
}

const absl::StatusOr<CublasApi>& Loaded() {
  static const absl::StatusOr<CublasApi>* const loaded = new absl::StatusOr<CublasApi>(Load());
  return *loaded;
}

// Whether LoadCublas has run (Loaded() must not be reached from LoadedCublas, which opens nothing).
std::atomic<bool> g_loaded{false};

}  // namespace

std::string CublasLibraryPath(bool lt, bool in_toolkit_dir) {
  return absl::StrCat(in_toolkit_dir ? SHARDSERVE_CUDA_LIBRARY_DIR "/" : "", lt ? "libcublasLt.so." : "libcublas.so.",
                      CUBLAS_VER_MAJOR);
}

absl::StatusOr<const CublasApi*> LoadCublas() {
  const absl::StatusOr<CublasApi>& loaded = Loaded();
  g_loaded.store(true, std::memory_order_release);
  if (!loaded.ok()) return loaded.status();
  return &*loaded;
}

const CublasApi* LoadedCublas() {
  if (!g_loaded.load(std::memory_order_acquire)) return nullptr;
  const absl::StatusOr<CublasApi>& loaded = Loaded();
  return loaded.ok() ? &*loaded : nullptr;
}

}  // namespace shardserve::cuda
