// The project's two status macros, for code that passes absl::Status / absl::StatusOr<T> up.
// Every module uses these (the CUDA, cuBLAS and NCCL checks in kernels/cuda/cuda_check.h and
// worker/comm build on them); no file defines its own.
//
//   SHARDSERVE_RETURN_IF_ERROR(file.Read(&header));              // returns the Status if not OK
//   SHARDSERVE_ASSIGN_OR_RETURN(Tensor w, Load("q_proj.weight"));  // declares w, or returns
//   SHARDSERVE_ASSIGN_OR_RETURN(w_, Load("o_proj.weight"));        // assigns, or returns
//
// The enclosing function returns absl::Status or absl::StatusOr<U> (which converts from a non-OK
// Status). Both macros evaluate `expr` exactly once.
#ifndef SHARDSERVE_BASE_STATUS_MACROS_H_
#define SHARDSERVE_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SHARDSERVE_RETURN_IF_ERROR(expr)                           \
  do {                                                             \
    ::absl::Status shardserve_status_ = (expr);                    \
    if (!shardserve_status_.ok()) return shardserve_status_;       \
  } while (0)

#define SHARDSERVE_STATUS_CONCAT_INNER_(a, b) a##b
#define SHARDSERVE_STATUS_CONCAT_(a, b) SHARDSERVE_STATUS_CONCAT_INNER_(a, b)

// `lhs` may be a declaration ("Tensor w") or an lvalue ("w_"); the temporary's name is unique per
// line, so several uses may share a scope.
#define SHARDSERVE_ASSIGN_OR_RETURN(lhs, expr) \
  SHARDSERVE_ASSIGN_OR_RETURN_IMPL_(SHARDSERVE_STATUS_CONCAT_(shardserve_statusor_, __LINE__), lhs, expr)

#define SHARDSERVE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                      \
  if (!tmp.ok()) return std::move(tmp).status();          \
  lhs = std::move(*tmp)

#endif  // SHARDSERVE_BASE_STATUS_MACROS_H_
