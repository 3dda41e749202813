// The CUDA backend's class (cuda_backend.cuh) outside its ops: creation and destruction, memory and
// copies, the device error word, the argument checks every op uses, and MakeCudaBackend.
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_backend.cuh"

namespace shardserve {
namespace cuda {

// ---- Host-side checks -------------------------------------------------------------------------
std::string TensorDesc(const Tensor& t) { return absl::StrCat(t.ShapeString(), " ", DTypeName(t.dtype)); }

// InvalidArgument "<op>: <why> (name [shape] dtype, ...)".
absl::Status Invalid(const char* op, absl::string_view why,
                     std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  std::string msg = absl::StrCat(op, ": ", why, " (");
  bool first = true;
  for (const auto& [name, t] : tensors) {
    absl::StrAppend(&msg, first ? "" : ", ", name, " ", t == nullptr ? std::string("null") : TensorDesc(*t));
    first = false;
  }
  return absl::InvalidArgumentError(absl::StrCat(msg, ")"));
}

bool Is(const Tensor& t, int ndim, DType dtype) {
  if (t.ndim != ndim || t.dtype != dtype) return false;
  for (int i = 0; i < ndim; ++i) {
    if (t.shape[i] < 0) return false;
  }
  return t.numel() == 0 || t.data != nullptr;
}

bool SameShape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] != b.shape[i]) return false;
  }
  return true;
}

bool FitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

CudaBackend::~CudaBackend() {
  // Errors are ignored: nothing can be done about them here, and the process may be exiting.
  (void)cudaSetDevice(ordinal_);
  if (recording_) {
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
  }
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  grouped_experts_.clear();  // their tables' Buffers free through this backend, still whole here
  for (const StepGraph& g : graphs_) (void)cudaGraphExecDestroy(g.exec);
  if (cublas_ != nullptr) (void)blas_->destroy(cublas_);
  if (lt_ != nullptr) (void)blas_->lt_destroy(lt_);
  if (params_dev_ != nullptr) (void)cudaFree(params_dev_);
  if (params_host_ != nullptr) (void)cudaFreeHost(params_host_);
  if (ids_dev_ != nullptr) (void)cudaFree(ids_dev_);
  if (dequant_dev_ != nullptr) (void)cudaFree(dequant_dev_);
  if (split_dev_ != nullptr) (void)cudaFree(split_dev_);
  if (errors_dev_ != nullptr) (void)cudaFree(errors_dev_);
  if (errors_host_ != nullptr) (void)cudaFreeHost(errors_host_);
  if (params_copied_ != nullptr) (void)cudaEventDestroy(params_copied_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::Init() {
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  cudaDeviceProp prop;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal_));
  device_name_ = prop.name;
  // Built for sm_80 and sm_90 (with sm_80 PTX for newer GPUs); bf16 needs sm_80 anyway.
  if (prop.major < 8) {
    return absl::FailedPreconditionError(absl::StrCat("MakeCudaBackend: cuda:", ordinal_, " (", device_name_,
                                                      ") has compute capability ", prop.major, ".", prop.minor,
                                                      "; shardserve's CUDA kernels need 8.0 or newer"));
  }
  pdl_ = options_.pdl && prop.major >= 9;
  // Non-blocking: the legacy default stream, used by other libraries, never stalls ours.
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  SHARDSERVE_ASSIGN_OR_RETURN(blas_, LoadCublas());
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->create(&cublas_));
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->set_stream(cublas_, stream_));
  // Default math: CUBLAS_COMPUTE_32F stays true float32 for F32 inputs (no TF32).
  SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->set_math_mode(cublas_, CUBLAS_DEFAULT_MATH));
  // fp8 tensor cores: Ada (8.9) and newer; elsewhere the option changes nothing.
  if (options_.fp8_gemm && (prop.major > 8 || (prop.major == 8 && prop.minor >= 9))) {
    SHARDSERVE_CUBLAS_RETURN_IF_ERROR(blas_->lt_create(&lt_));
  }
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&errors_dev_, sizeof(unsigned)));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMallocHost(&errors_host_, sizeof(unsigned)));
  *errors_host_ = 0;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(errors_dev_, 0, sizeof(unsigned), stream_));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&params_copied_, cudaEventDisableTiming));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

// Makes this backend's device current for the calling thread (streams and handles belong to it).
absl::Status CudaBackend::Activate() const {
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
  return absl::OkStatus();
}

absl::Status CudaBackend::SyncAndCheck() {
  SHARDSERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(errors_host_, errors_dev_, sizeof(unsigned), cudaMemcpyDeviceToHost, stream_));
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  const unsigned bits = *errors_host_;
  if (bits == 0) return absl::OkStatus();
  *errors_host_ = 0;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(errors_dev_, 0, sizeof(unsigned), stream_));
  std::string msg = "bad step metadata found on the device since the last check:";
  if (bits & kErrAttentionSeq) absl::StrAppend(&msg, " Attention: a token_seq entry outside [0, seqs);");
  if (bits & kErrAttentionPos) {
    absl::StrAppend(&msg, " Attention: a position < 0 or beyond its block table (max_blocks * block_size);");
  }
  if (bits & kErrAttentionBlock) absl::StrAppend(&msg, " Attention: a block table entry outside [0, num_blocks);");
  if (bits & (kErrAttentionSeq | kErrAttentionPos | kErrAttentionBlock)) {
    absl::StrAppend(&msg, " (last Attention had ", attention_limits_, "; those keys were skipped, rows zeroed)");
  }
  if (bits & kErrCacheSlot) {
    absl::StrAppend(&msg, " CacheWrite: a slot outside [0, num_blocks * block_size) (last CacheWrite had ",
                    cache_limits_, "; those tokens were not written);");
  }
  if (bits & kErrMoeLogit) {
    absl::StrAppend(&msg, " MoeRoute: a NaN or infinite router logit or selection bias (those tokens' ids are -1);");
  }
  if (bits & kErrMoeExpert) {
    absl::StrAppend(&msg, " MoeGroupByExpert: an expert id outside [0, E) (those pairs were left out, rows -1);");
  }
  if (bits & kErrMoeRow) absl::StrAppend(&msg, " MoeCombine: a row outside [0, expert_rows) (skipped);");
  if (bits & kErrMoeOffsets) {
    absl::StrAppend(&msg, " MoeCountRows / MoeExperts: offsets decreasing or past the rows (those experts skipped);");
  }
  return absl::InvalidArgumentError(msg);
}

absl::StatusOr<Buffer> CudaBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer(this, nullptr, 0);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    return absl::ResourceExhaustedError(absl::StrCat("Allocate: cudaMalloc of ", bytes, " bytes on cuda:", ordinal_,
                                                     " failed (", cudaGetErrorName(e), "); ", free_bytes, " of ",
                                                     total_bytes, " bytes free"));
  }
  return Buffer(this, p, bytes);
}

void CudaBackend::Free(void* data) {
  if (data == nullptr) return;
  quantized_.erase(data);
  (void)cudaSetDevice(ordinal_);
  (void)cudaFree(data);  // waits for work still using it
}

absl::Status CudaBackend::CopyToDevice(void* dst, const void* host_src, size_t bytes) {
  if (recording_) return SpoilRecording("CopyToDevice");
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || host_src == nullptr) return absl::InvalidArgumentError("CopyToDevice: null pointer");
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  // For pinned host memory the copy is asynchronous; the caller may reuse host_src on return.
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyToHost(void* host_dst, const void* src, size_t bytes) {
  if (recording_) return SpoilRecording("CopyToHost");
  if (bytes == 0) return absl::OkStatus();
  if (host_dst == nullptr || src == nullptr) return absl::InvalidArgumentError("CopyToHost: null pointer");
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  return SyncAndCheck();
}

absl::Status CudaBackend::CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("CopyOnDevice: null pointer");
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fill0(void* dst, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError("Fill0: null pointer");
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, 0, bytes, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize() {
  if (recording_) return SpoilRecording("Synchronize");
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return SyncAndCheck();
}

// ---- Step graphs --------------------------------------------------------------------------------
// A recording is a stream capture of stream_ (ThreadLocal: this thread's calls that would wait for
// the device fail during it; other threads' are unaffected). Each op's launch is captured with its
// arguments; the kernels' device error word (errors_dev_) is an address like any other, so a
// replayed kernel still reports bad step metadata at the next SyncAndCheck.
absl::Status CudaBackend::SpoilRecording(const char* op) {
  const std::string why =
      absl::StrCat(op, ": waits for the device, which a step graph being recorded cannot (BeginGraph .. EndGraph)");
  if (recording_refused_.empty()) recording_refused_ = why;
  return absl::FailedPreconditionError(why);
}

absl::Status CudaBackend::BeginGraph() {
  if (!options_.step_graphs) {
    return absl::UnimplementedError(
        "BeginGraph: step graphs are off on this CUDA backend (CudaBackendOptions::step_graphs; the worker's "
        "--no-cuda-graphs; docs/gpu.md)");
  }
  if (recording_) return absl::FailedPreconditionError("BeginGraph: a step graph is already being recorded");
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  recording_ = true;
  recording_refused_.clear();
  recording_from_ = KernelLaunches().load(std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<int> CudaBackend::EndGraph() {
  if (!recording_) return absl::FailedPreconditionError("EndGraph: no step graph is being recorded");
  recording_ = false;
  // The launches recorded did not run: they count each time the graph runs.
  const uint64_t kernels = KernelLaunches().load(std::memory_order_relaxed) - recording_from_;
  KernelLaunches().fetch_sub(kernels, std::memory_order_relaxed);
  (void)cudaSetDevice(ordinal_);  // the capture ends whatever else fails
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = ended == cudaSuccess && recording_refused_.empty()
                               ? cudaGraphInstantiate(&exec, graph, 0)
                               : cudaSuccess;
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  if (!recording_refused_.empty()) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(std::exchange(recording_refused_, std::string()));
  }
  if (ended != cudaSuccess || made != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: the stream works on, uncaptured
    return ended != cudaSuccess
               ? CudaErrorToStatus(ended, "cudaStreamEndCapture (a call during the recording spoiled it)", __FILE__,
                                   __LINE__)
               : CudaErrorToStatus(made, "cudaGraphInstantiate", __FILE__, __LINE__);
  }
  graphs_.push_back(StepGraph{exec, kernels});
  return static_cast<int>(graphs_.size()) - 1;
}

absl::Status CudaBackend::RunGraph(int id) {
  if (recording_) return absl::FailedPreconditionError("RunGraph: a step graph is being recorded");
  if (id < 0 || static_cast<size_t>(id) >= graphs_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("RunGraph: no step graph ", id, " (", graphs_.size(), " recorded)"));
  }
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graphs_[static_cast<size_t>(id)].exec, stream_));
  KernelLaunches().fetch_add(graphs_[static_cast<size_t>(id)].kernels, std::memory_order_relaxed);
  return absl::OkStatus();
}

}  // namespace cuda

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int ordinal, DType act, const CudaBackendOptions& options) {
  if (act != DType::kF32 && act != DType::kF16 && act != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("MakeCudaBackend: activation dtype ", DTypeName(act),
                                                   " is not supported; use F32, F16 or BF16"));
  }
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("MakeCudaBackend(cuda:", ordinal, "): no usable CUDA device (",
                                               cudaGetErrorName(e), ": ", cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    return absl::UnavailableError(absl::StrCat("MakeCudaBackend(cuda:", ordinal, "): no CUDA device on this machine"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("MakeCudaBackend: device ordinal ", ordinal,
                                                   " is out of range; this machine has ", count,
                                                   " CUDA device(s), ordinals 0..", count - 1));
  }
  auto backend = std::make_unique<cuda::CudaBackend>(ordinal, act, options);
  SHARDSERVE_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

int CudaComputeCapability(int ordinal) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return 10 * major + minor;
}

}  // namespace shardserve
