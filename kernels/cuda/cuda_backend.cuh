// The CUDA backend (kernels/backend.h): the CudaBackend class, shared by the files that define it:
// cuda_backend.cu (lifetime, memory, error word), elementwise.cu, matmul.cu, attention.cu and
// sampling.cu (the ops and their kernels), counter_uniform.cu (the dummy weights' generator),
// quant_matmul.cu (int8 / int4 / fp8 weights, behind CudaBackendOptions::quantized_kernels).
// Internal to kernels/cuda/; everything else uses MakeCudaBackend (kernels/cuda/cuda_backend.h).
//
// cuBLAS for MatMul, kernels for everything else; by quantized weights, our GEMV for decode and
// dequantize + cuBLAS for more rows (quant_matmul.cu).
//
// Activations are float, __half or __nv_bfloat16 (the backend's act dtype); every kernel converts
// to float on load, accumulates in float (double for the sampling masses) and rounds once on
// store. Logits, softmax output and sampling inputs are float32.
//
// Ownership and lifetime: a CudaBackend owns one cudaStream_t, one cublasHandle_t and a few small
// scratch buffers, all created in MakeCudaBackend and destroyed in the destructor. Buffers it
// hands out (Allocate) must be freed before it is destroyed. Not thread-safe: one thread at a
// time, as backend.h says.
//
// Ordering: every op and CopyOnDevice/Fill0 are enqueued on the stream and return before the GPU
// is done. CopyToDevice returns once the host source may be reused, CopyToHost once the host
// destination holds the data (both synchronize the stream). Argmax and Sample with a host output
// tensor also synchronize.
//
// Step graphs (CudaBackendOptions::step_graphs, off by default, never yet run on a GPU): between
// BeginGraph and EndGraph the stream is captured, so the ops above are recorded, not run, and
// RunGraph launches the recording as one CUDA graph. The calls that synchronize are refused during
// a recording (it is spoiled: EndGraph returns why).
//
// Bad metadata: block-table entries, sequence ids, positions and cache slots live on the device,
// so the host cannot check them without a synchronization. The kernels check them instead, skip
// what is out of range (never reading or writing outside a tensor) and set a bit in a device
// error word; the next Synchronize() or CopyToHost() (or Argmax/Sample to host) returns an
// InvalidArgument naming the op and clears the word. The MoE ops' bad ids, rows and non-finite
// router logits are reported the same way.
#ifndef SHARDSERVE_KERNELS_CUDA_CUDA_BACKEND_CUH_
#define SHARDSERVE_KERNELS_CUDA_CUDA_BACKEND_CUH_

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cuda/cublas_api.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/tensor.h"

namespace shardserve::cuda {

// ---- Launch configuration (why these numbers) -------------------------------------------------
// Elementwise ops: 256 threads per block is the usual sweet spot for memory-bound kernels on
// A100/H100 (8 blocks per SM at full occupancy); grid-stride loops cap the grid (GridFor).
constexpr int kElementwiseThreads = 256;
// RmsNorm: one block per row; hidden sizes are 2k-16k, so 1024 threads do 2-16 elements each: a
// row of up to 8192 (kRowLoads a thread) is read in one round and kept in registers for the second
// pass, which a decode step's few rows wait on (a launch of one row takes a few memory latencies).
constexpr int kRmsNormThreads = 1024;
// Softmax, Argmax, Sample: one block per row over a vocabulary of 32k-152k; rows are few (the
// batch), so a wide block keeps more loads in flight per row. 512 leaves room for the double
// accumulators of Sample without spilling.
constexpr int kRowThreads = 512;
// Attention: one block per (token, query head); each thread scores one key of a 128-key chunk,
// then each warp sums the weighted values of a quarter of the chunk's keys, a lane four dims of
// each run of 128 (kAttnRunDims) of the head. Head dims up to 512 are supported (Llama-family
// models use 64-256). (Lanes splitting head_dim per key, one key per warp at a time, left every
// key's loads waiting on the previous key's: 72 us for 140 keys of a 64-dim head on an H100.)
constexpr int kAttnThreads = 128;
constexpr int kAttnChunk = kAttnThreads;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnMaxHeadDim = 512;
constexpr int kAttnRunDims = 32 * 4;
constexpr int kAttnRuns = kAttnMaxHeadDim / kAttnRunDims;
// Split-KV attention (CudaBackendOptions::split_attention_keys): steps of at most this many tokens
// split each (token, head)'s keys into at most kAttnMaxSplits ranges of at least the option's keys,
// the ranges' partial softmax sums in a scratch buffer sized once for the largest such step, then
// combined. A larger step has blocks enough without splitting.
constexpr int kAttnSplitMaxTokens = 8;
constexpr int kAttnMaxSplits = 64;
// MatMuls: the most products of one x the dense GEMV computes in one launch (q, k and v).
constexpr int kDenseGemvMaxProducts = 3;

// Bits of the device error word.
enum : unsigned {
  kErrAttentionSeq = 1u << 0,    // token_seq[t] outside [0, seqs)
  kErrAttentionPos = 1u << 1,    // positions[t] < 0 or beyond the block table
  kErrAttentionBlock = 1u << 2,  // block table entry outside [0, num_blocks)
  kErrCacheSlot = 1u << 3,       // slots[t] outside [0, num_blocks * block_size)
  kErrMoeLogit = 1u << 4,        // MoeRoute: a NaN or infinite logit or selection bias
  kErrMoeExpert = 1u << 5,       // MoeGroupByExpert: an id outside [0, E)
  kErrMoeRow = 1u << 6,          // MoeCombine: a row outside [0, expert_rows)
  kErrMoeOffsets = 1u << 7,      // MoeCountRows, MoeExperts: offsets decreasing (or past x's rows)
};

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) with T the device type of a float dtype.
template <typename F>
absl::Status DispatchFloat(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      return f(Tag<float>{});
    case DType::kF16:
      return f(Tag<__half>{});
    case DType::kBF16:
      return f(Tag<__nv_bfloat16>{});
    default:
      return absl::InternalError(absl::StrCat("CUDA backend: no kernels for dtype ", DTypeName(t)));
  }
}

// ---- Host-side checks (cuda_backend.cu) -------------------------------------------------------
std::string TensorDesc(const Tensor& t);

// InvalidArgument "<op>: <why> (name [shape] dtype, ...)".
absl::Status Invalid(const char* op, absl::string_view why,
                     std::initializer_list<std::pair<const char*, const Tensor*>> tensors);

bool Is(const Tensor& t, int ndim, DType dtype);

bool SameShape(const Tensor& a, const Tensor& b);

bool FitsInt(int64_t v);
// cuBLAS's data type of a float DType (F32, F16, BF16; matmul.cu).
cudaDataType_t CudaDataType(DType t);

// ---- The backend ------------------------------------------------------------------------------
class CudaBackend final : public Backend {
 public:
  CudaBackend(int ordinal, DType act, const CudaBackendOptions& options)
      : ordinal_(ordinal), act_(act), options_(options) {}
  ~CudaBackend() override;

  // Creates the stream, the cuBLAS handle and the fixed scratch. Called once by MakeCudaBackend;
  // on failure the destructor releases what was created.
  absl::Status Init();

  DeviceKind device_kind() const override { return DeviceKind::kCuda; }
  DType act_dtype() const override { return act_; }
  std::string Describe() const override {
    return absl::StrCat("cuda:", ordinal_, " (", device_name_, ", ", absl::AsciiStrToLower(DTypeName(act_)),
                        lt_ != nullptr ? ", fp8 prefill by cuBLASLt on e4m3-rounded x" : "",
                        options_.int4_folded && act_ != DType::kF32 ? ", int4 decode with the zero folded out" : "",
                        ")");
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  void Free(void* data) override;
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override;
  absl::Status Fill0(void* dst, size_t bytes) override;
  absl::Status Synchronize() override;
  absl::Status FillCounterUniform(Tensor* out, const CounterUniformSlice& slice) override;  // counter_uniform.cu
  uint64_t kernel_launches() const override { return KernelLaunches().load(std::memory_order_relaxed); }
  // Step graphs (cuda_backend.cu): stream capture of this backend's stream, cudaGraphLaunch.
  bool records_graphs() const override { return options_.step_graphs; }
  absl::Status BeginGraph() override;
  absl::StatusOr<int> EndGraph() override;
  absl::Status RunGraph(int id) override;
  uint64_t dequant_scratch_bytes() const override { return dequant_capacity_; }
  // Quantized weights (quant_matmul.cu): kernels/quant.h's layouts copied to the device as they
  // are; kNone is the base's (plain weights, no copy). Unimplemented unless
  // options_.quantized_kernels.
  absl::StatusOr<Buffer> PackMatMulWeight(const Tensor& w, Tensor* packed, WeightQuant quant) override;
  absl::StatusOr<Buffer> PackQuantizedWeight(WeightQuant quant, const void* stored, int64_t m, int64_t k,
                                             Tensor* packed, int64_t group = 0) override;
  void ReleaseLoadBuffers() override {
    pack_raw_ = {};
    pack_stored_ = {};
  }

  absl::Status Embedding(Tensor* out, const Tensor& table, const Tensor& ids, int64_t row_offset) override;
  absl::Status RmsNorm(Tensor* out, const Tensor& x, const Tensor& w, float eps) override;
  // One kernel with options_.fused_kernels (elementwise.cu), else the base's Add then RmsNorm.
  absl::Status AddRmsNorm(Tensor* x, const Tensor& y, Tensor* normed, const Tensor& w, float eps) override;
  absl::Status MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) override;
  // One dense GEMV launch when every product takes it (up to kDenseGemvMaxProducts, one output
  // dtype), else the base's MatMul each (matmul.cu).
  absl::Status MatMuls(const Tensor& x, absl::Span<const MatMulProduct> products) override;
  absl::Status Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim,
                    const RopeOptions& options) override;
  absl::Status CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                          const Tensor& slots) override;  // attention.cu
  // One kernel with options_.fused_kernels (elementwise.cu), else the base's Rope then CacheWrite.
  absl::Status RopeCacheWrite(Tensor* q, Tensor* k, const Tensor& v, const Tensor& positions, const Tensor& inv_freq,
                              int head_dim, const RopeOptions& options, Tensor* k_cache, Tensor* v_cache,
                              const Tensor& slots) override;
  absl::Status Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                         float scale, const AttentionOptions& options) override;
  // mla_attention.cu.
  absl::Status MlaAttention(Tensor* out, const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_c,
                            const Tensor& k_pe, const Tensor& kv_b, Tensor* cache, const Tensor& slots,
                            const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables, float scale,
                            const MlaShape& shape) override;
  absl::Status SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) override;
  absl::Status GeluTanhMul(Tensor* out, const Tensor& gate, const Tensor& up) override;
  absl::Status ClampedSwiGlu(Tensor* out, const Tensor& gate, const Tensor& up, float alpha, float limit) override;
  absl::Status Scale(Tensor* out, const Tensor& x, float factor) override;
  absl::Status Softcap(Tensor* x, float cap) override;
  // One dense GEMV launch with options_.fused_kernels where MatMuls would take one for the two
  // products (gemv.cu), else the base's MatMuls then SiluMul.
  absl::Status GateUpSilu(Tensor* gate, Tensor* up, const Tensor& x, const Tensor& gate_w,
                          const Tensor& up_w) override;
  absl::Status Add(Tensor* out, const Tensor& a, const Tensor& b) override;
  absl::Status Softmax(Tensor* out, const Tensor& x, float temperature) override;
  absl::Status Argmax(Tensor* out, const Tensor& logits) override;
  absl::Status FiniteRows(Tensor* out, const Tensor& logits) override;
  absl::Status Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) override;
  // moe.cu.
  absl::Status MoeRoute(Tensor* ids, Tensor* weights, const Tensor& logits, const MoeRouting& routing) override;
  absl::Status MoeGroupByExpert(Tensor* order, Tensor* rows, Tensor* offsets, Tensor* tokens,
                                const Tensor& ids) override;
  absl::Status MoeCountRows(Tensor* counts, const Tensor& offsets, int64_t begin, int64_t end) override;
  absl::Status MoeCombine(Tensor* out, const Tensor& expert_out, const Tensor& rows, const Tensor& weights) override;
  absl::Status SigmoidGateMul(Tensor* out, const Tensor& x, const Tensor& gate) override;
  bool records_moe_experts() const override { return options_.moe_grouped; }
  absl::Status MoeExperts(Tensor* out, Tensor* gate, Tensor* up, const Tensor& x, const Tensor& offsets,
                          const MoeExpertWeights& w) override;

 private:
  absl::Status Activate() const;
  // Refuses `op` (a call that waits for the device) during a recording, and spoils the recording:
  // EndGraph returns the refusal.
  absl::Status SpoilRecording(const char* op);
  // Waits for the stream, then turns a set device error word into a Status (and clears it).
  absl::Status SyncAndCheck();
  // Where an op writes n i32 ids for `out`: `out` itself when it is this device's memory, else
  // (host memory) the ids scratch, copied back by FinishIds.
  absl::StatusOr<int32_t*> IdsTarget(const char* op, const Tensor& out, bool* to_host);
  absl::Status FinishIds(const Tensor& out, bool to_host);
  // Argmax's and FiniteRows' body: checks out [n] I32 and logits [n, v > 0] F32, then launches
  // `kernel` (one block of kRowThreads a row, one int32 a row) into out, device or host memory.
  absl::Status RowsToIds(const char* op, const char* kernel_name, void (*kernel)(int32_t*, const float*, int64_t),
                         Tensor* out, const Tensor& logits);
  absl::Status UploadSampleParams(const std::vector<SampleParams>& params);
  template <typename T>
  absl::Status GrowDevice(T** ptr, size_t* capacity, size_t needed);
  // The dequantize scratch's limit (options_.quantized_scratch_bytes, else kCudaDequantScratchBytes)
  // and what a quantized weight [m, k] needs of it (CudaDequantScratchBytes, kernels/backend.h).
  uint64_t DequantScratchLimit() const {
    return options_.quantized_scratch_bytes > 0 ? options_.quantized_scratch_bytes : kCudaDequantScratchBytes;
  }
  size_t DequantScratchBytes(int64_t m, int64_t k) const {
    return static_cast<size_t>(CudaDequantScratchBytes(m, k, act_, DequantScratchLimit()));
  }
  // SiluMul's (gelu_tanh false) and GeluTanhMul's (true) checks and launch (elementwise.cu).
  absl::Status GatedMul(const char* op, bool gelu_tanh, Tensor* out, const Tensor& gate, const Tensor& up);
  // Rope's and CacheWrite's checks (CacheWrite's also notes the cache's limits for error messages),
  // and Rope with, when v is given, the cache write in the same kernel (elementwise.cu).
  absl::Status CheckRope(const Tensor* q, const Tensor* k, const Tensor& positions, const Tensor& inv_freq,
                         int head_dim, const RopeOptions& options) const;
  absl::Status CheckCacheWrite(const Tensor* k_cache, const Tensor* v_cache, const Tensor& k, const Tensor& v,
                               const Tensor& slots);
  absl::Status RopeAndMaybeCacheWrite(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq,
                                      int head_dim, const RopeOptions& options, const Tensor* v, Tensor* k_cache,
                                      Tensor* v_cache, const Tensor* slots);
  // fp8 weights' products through cuBLASLt's fp8 GEMM (fp8_gemm.cu; options_.fp8_gemm on a GPU of
  // compute capability 8.9+): whether it takes a weight [m, k] whose codes are at `codes` and an
  // output at `out`, and out [n, m] (+)= x [n, k] rounded to e4m3 per row @ codes^T, scaled by
  // w_scale [m] and x's row scales (beta 1: onto out's contents, the broadcast bias). False: nothing
  // was written, cuBLASLt offered no algorithm (the dequantize path runs instead).
  bool Fp8GemmTakes(int64_t m, int64_t k, const void* codes, const void* out) const;
  absl::StatusOr<bool> Fp8Gemm(void* out, DType out_dtype, const void* x, int64_t n, int64_t m, int64_t k,
                               const uint8_t* codes, const float* w_scale, float beta);
  // MatMul's checks of a product by a weight in the act dtype: dtypes, shapes, cuBLAS's int range.
  absl::Status CheckPlainMatMul(const Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) const;
  // Whether MatMul multiplies x by the dense weight w with DenseGemv (options_.dense_gemv, a
  // decode-sized x, aligned rows of a multiple of 8), and the products themselves, checked, each
  // taking it, one output dtype, m > 0, in one launch (gemv.cu).
  bool TakesDenseGemv(const Tensor& x, const Tensor& w) const;
  // Whether MatMuls computes `products` (2 to kDenseGemvMaxProducts) in one DenseGemv launch: each
  // plain, passing CheckPlainMatMul, taking the dense GEMV, m > 0, one output dtype.
  bool TakesOneDenseGemv(const Tensor& x, absl::Span<const MatMulProduct> products) const;
  // silu: products are gate and up of one shape, act outputs, and gate receives silu x up (each
  // block a row of both; up is not written).
  absl::Status DenseGemv(const Tensor& x, absl::Span<const MatMulProduct> products, bool silu = false);
  // PackMatMulWeight's host buffers for quantizing (the weight in the act dtype, its quantized
  // bytes), kept at the largest weight's size for the next weight until ReleaseLoadBuffers.
  std::vector<uint8_t> pack_raw_, pack_stored_;
  // MatMul by a weight PackMatMulWeight / PackQuantizedWeight stored quantized (quant_matmul.cu).
  absl::Status QuantizedMatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias);
  // Out starts as the bias broadcast over its rows (matmul.cu), for a GEMM with beta = 1.
  absl::Status BroadcastBias(Tensor* out, const Tensor& bias);
  // The cuBLAS product out[:, r0 : r0 + rows] (=) x @ w^T for w [rows, k] in the act dtype, out
  // [n, m] (ld m), accumulating onto out when beta is 1 (matmul.cu).
  absl::Status Gemm(void* out, DType out_dtype, int64_t m, const void* x, const void* w, int64_t n, int64_t rows,
                    int64_t k, float beta);

  // Launches kernel<<<grid, threads, 0, stream_>>>(args...) and counts it (KernelLaunches), its
  // error named by `what`; with pdl_ as a programmatic dependent launch
  // (cudaLaunchKernelEx with cudaLaunchAttributeProgrammaticStreamSerialization): its blocks may
  // start before the kernel ahead of it has finished, so every kernel launched here calls
  // WaitForPriorKernels (device_util.cuh) before it reads or writes any buffer an earlier kernel
  // touches. Without pdl_ the launch is the plain one the kernels passed their tests with.
  template <typename... Params, typename... Args>
  absl::Status Launch(const char* what, void (*kernel)(Params...), unsigned grid, unsigned threads, Args&&... args) {
    CountLaunch();
    if (!pdl_) {
      kernel<<<grid, threads, 0, stream_>>>(std::forward<Args>(args)...);
      return CudaErrorToStatus(cudaGetLastError(), what, __FILE__, __LINE__);
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = 0;
    config.stream = stream_;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
    if (e != cudaSuccess) (void)cudaGetLastError();  // reported here, not again at the next launch
    return CudaErrorToStatus(e, what, __FILE__, __LINE__);
  }

  // Constant after Init().
  const int ordinal_;
  const DType act_;
  const CudaBackendOptions options_;
  // options_.pdl on a device of compute capability 9.0 or newer (Launch).
  bool pdl_ = false;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  const CublasApi* blas_ = nullptr;  // cuBLAS and cuBLASLt, opened by Init (cublas_api.h)
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;    // options_.fp8_gemm on compute capability 8.9+ only (Fp8Gemm)
  unsigned* errors_dev_ = nullptr;   // device error word (kErr* bits)
  unsigned* errors_host_ = nullptr;  // pinned mirror, read after a stream sync
  cudaEvent_t params_copied_ = nullptr;

  // Scratch grown on demand (never shrunk), used only from the owning thread.
  SampleParams* params_dev_ = nullptr;   // [params_capacity_]
  SampleParams* params_host_ = nullptr;  // pinned staging for the upload, [params_capacity_]
  size_t params_capacity_ = 0;
  int32_t* ids_dev_ = nullptr;  // [ids_capacity_], Argmax/Sample results bound for host memory
  size_t ids_capacity_ = 0;
  // The quantized weights this backend stored, by their buffer's address (PackQuantized in
  // quant_matmul.cu; Free forgets them): MatMul checks that a quantized w is one of them, whole.
  struct QuantizedWeight {
    int64_t m = 0, k = 0;
    WeightQuant quant = WeightQuant::kNone;
    // int4: every group's zero below 128 (Int4MmaGemvKernel forms 128 + zero exactly in bf16).
    bool small_zeros = false;
    // fp8: inputs per scale (kernels/quant.h Fp8RowsLayout::group; 0: one scale a row).
    int64_t group = 0;
  };
  std::map<const void*, QuantizedWeight> quantized_;
  // MoeExperts with options_.moe_grouped (moe.cu): per layer (keyed by its gate_proj span's
  // address), the experts' weight and bias pointers as the grouped GEMV reads them, on the device
  // (six arrays of E), and the host copy they are checked against at each call (rebuilt when the
  // weights moved; null when some expert's weights are not plain act-dtype ones: the host loop).
  struct GroupedExperts {
    std::vector<const void*> host;  // [6 * E]: gate, up, down, gate bias, up bias, down bias
    Buffer table;                   // its device copy
    bool grouped = false;
  };
  std::map<const void*, GroupedExperts> grouped_experts_;
  absl::StatusOr<const GroupedExperts*> GroupedTable(const MoeExpertWeights& w, int64_t f, int64_t h, int64_t d);
  // The dequantized rows of a quantized weight for the cuBLAS path (act dtype), grown as each
  // quantized weight is stored to DequantScratchBytes of it (a power of two: the largest of them),
  // never shrunk.
  uint8_t* dequant_dev_ = nullptr;
  size_t dequant_capacity_ = 0;
  // Split-KV attention's partial sums (attention.cu), [kAttnSplitMaxTokens x q_heads x
  // kAttnMaxSplits x (head_dim + 2)] floats, allocated at the first split Attention and never
  // reallocated for the same heads, so that a step graph recorded with it stays valid.
  float* split_dev_ = nullptr;
  size_t split_capacity_ = 0;
  // Step graphs recorded so far (by id) with the kernels each launches, and the recording under
  // way: KernelLaunches() when it began (the launches it records are not counted until they run).
  struct StepGraph {
    cudaGraphExec_t exec = nullptr;
    uint64_t kernels = 0;
  };
  std::vector<StepGraph> graphs_;
  bool recording_ = false;
  uint64_t recording_from_ = 0;
  std::string recording_refused_;  // the first call refused during the recording (SpoilRecording)
  // What the last Attention / CacheWrite launch allowed, for error messages.
  std::string attention_limits_;
  std::string cache_limits_;
};

// (Scratch growth, shared by sampling.cu and quant_matmul.cu.)
template <typename T>
inline absl::Status CudaBackend::GrowDevice(T** ptr, size_t* capacity, size_t needed) {
  if (needed <= *capacity) return absl::OkStatus();
  // Rare (the batch grew): wait for work that may still use the old buffer, then reallocate with
  // headroom so that the next few growths are free. The capacity reads 0 until the new buffer
  // exists, so a failure here leaves no stale capacity behind.
  const size_t cap = std::max<size_t>({needed, 64, 2 * *capacity});
  *capacity = 0;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (*ptr != nullptr) SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaFree(*ptr));
  *ptr = nullptr;
  SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(ptr), cap * sizeof(T)));
  *capacity = cap;
  return absl::OkStatus();
}

}  // namespace shardserve::cuda

#endif  // SHARDSERVE_KERNELS_CUDA_CUDA_BACKEND_CUH_
