// The math a Llama-family forward pass needs, behind one interface with two implementations:
// CpuBackend (float32, oneDNN for matrix products) and CudaBackend (F32/F16/BF16 activations,
// cuBLAS for matrix products, our own kernels for the rest).
//
// MakeCpuBackend is declared below; MakeCudaBackend, with the switches of the CUDA backend's paths
// (CudaBackendOptions), in the CUDA backend's own header, kernels/cuda/cuda_backend.h (their
// command-line switches: kernels/cuda/cuda_switches.h).
//
// Conventions
// - Every op writes its output first and states shapes in comments. All tensors passed to an op
//   live on that backend's device (host memory for the CPU backend, device memory for CUDA).
// - "act" is the activation dtype the backend was created with: F32 on CPU; F32, F16 or BF16 on
//   CUDA. Weights passed to MatMul, RmsNorm and Embedding have the act dtype. Logits, softmax
//   output and sampling inputs are F32. Ids, positions, slots and block tables are I32.
// - Ops on CUDA are enqueued on the backend's stream and may still run when the call returns;
//   Synchronize() waits. Errors from launches and library calls come back as absl::Status.
//   Bad step metadata that only the device can see (a block index, slot or position out of
//   range) is skipped by the CUDA kernels and reported as InvalidArgument by the next
//   Synchronize() or CopyToHost(); the CPU backend reports it from the op itself, before writing.
//   Callers validate metadata on the host first (worker/step_checks.h does), so this is a backstop.
// - CopyToDevice returns once the host source may be reused; CopyToHost once the data is there.
// - Shape or dtype mismatches are reported as InvalidArgument naming the op and the shapes.
//
// Threading: a Backend is used by one thread at a time (the worker's step loop). It is not
// thread-safe.
//
// The KV cache is paged: k_cache and v_cache are [num_blocks, block_size, kv_heads, head_dim].
// A token's cache slot is block * block_size + offset; a sequence's block table lists its blocks
// in order, so position p of a sequence lives in slot table[p / block_size] * block_size +
// p % block_size.
#ifndef SHARDSERVE_KERNELS_BACKEND_H_
#define SHARDSERVE_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/counter_uniform.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"

namespace shardserve {

class Backend;

// Slots are I32 (above), so a KV cache holds at most 2^31 tokens, whatever the memory: the
// planner sizes no cache beyond it and a worker accepts none.
constexpr int64_t kMaxKvCacheTokens = int64_t{1} << 31;

// Owns one allocation on a backend's device. Move-only; frees on destruction. The Backend that
// made it must outlive it.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend* owner, void* data, size_t bytes) : owner_(owner), data_(data), bytes_(bytes) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // A tensor view of the start of this buffer. The caller checks that the shape fits.
  Tensor View(DType t, std::initializer_list<int64_t> dims) const { return Tensor(data_, t, dims); }

 private:
  Backend* owner_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Per-row sampling parameters for Backend::Sample.
struct SampleParams {
  float temperature = 1.0f;  // > 0. (Greedy decoding uses Argmax instead.)
  int32_t top_k = 0;         // 0 = no limit. Keeps every token whose prob >= the k-th largest.
  float top_p = 1.0f;        // (0, 1]. Keeps the smallest set of most likely tokens with mass >= top_p.
  float uniform = 0.5f;      // the row's random draw in [0, 1), from SampleUniform (kernels/sampling.h).
};

// One product of Backend::MatMuls: out = x @ w^T (+ bias, which may be null).
struct MatMulProduct {
  Tensor* out = nullptr;
  const Tensor* w = nullptr;
  const Tensor* bias = nullptr;
};

// Per-call options of Backend::Attention, each off at its default (then Attention gives the same
// bits as without them). Transformers' eager attention is the reference for each.
struct AttentionOptions {
  // Sliding window (Mistral; Gemma 2 and 3's local layers): 0 = none, else > 0, and the token at
  // position p attends only to positions j with p - j < window, i.e. j in (p - window, p]: the
  // causal mask and transformers' sliding_window_overlay (masking_utils.py,
  // create_sliding_window_causal_mask: kv_idx > q_idx - sliding_window). Keys before the window
  // are not read, nor their block-table entries (they may name freed blocks).
  int64_t window = 0;
  // Logit soft-capping (Gemma 2's attn_logit_softcapping): 0 = none, else finite and > 0, and each
  // score s = (q . k) * scale becomes softcap * tanh(s / softcap) before the mask and the softmax
  // (modeling_gemma2.py's eager_attention_forward: scaling, then capping, then mask).
  float softcap = 0.0f;
  // Attention sinks (gpt-oss): null = none, else [q_heads] F32 on the backend's device, query
  // head h's sink logit (this rank's heads), which joins the softmax but adds no value: the scores
  // with the sink appended, the max (sink included) subtracted, the softmax taken, and the sink's
  // column dropped (modeling_gpt_oss.py's eager_attention_forward), so the kept weights sum to less
  // than 1. Finite values (the CPU backend refuses others; the CUDA backend does not read them on
  // the host). The caller owns it; it must stay alive until the op has run.
  const Tensor* sinks = nullptr;
};

// What a rotary embedding adds to the plain one (Backend::Rope): a rotated part of each head,
// transformers' attention factor on cos and sin, and LongRoPE's second set of frequencies.
struct RopeOptions {
  // Dimensions rotated at the start of each head (partial_rotary_factor; Phi-4-mini rotates 3/4):
  // 0 = the whole head, else even and in [2, head_dim]; the pairs are (x[i], x[i + rotary_dim / 2])
  // for i < rotary_dim / 2 and the dimensions from rotary_dim on pass through unchanged. inv_freq
  // (and long_inv_freq) then has rotary_dim / 2 entries.
  int rotary_dim = 0;
  // cos and sin are each multiplied by this in float32 before the rotation (yarn's and longrope's
  // attention_factor, transformers' attention_scaling): finite and > 0. With a partial rotary
  // embedding it scales only the rotated dimensions, so it is not a factor of the attention scores.
  float attention_factor = 1.0f;
  // LongRoPE: null = none, else [rotary_dim / 2] F32 on the backend's device, the frequencies of
  // the tokens at positions >= long_from (inv_freq is then the ones below it). The caller owns it;
  // it must stay alive until the op has run.
  const Tensor* long_inv_freq = nullptr;
  int64_t long_from = 0;
};

// InvalidArgument naming `op` and the option when `options` is not valid for a rotary embedding of
// heads of head_dim (rotary_dim odd, negative or past head_dim; attention_factor not finite and
// > 0; long_inv_freq not [rotary_dim / 2] F32 or without data; long_from < 0). Both backends check
// with it.
absl::Status CheckRopeOptions(const char* op, const RopeOptions& options, int head_dim);

// InvalidArgument naming `op` and the option when `options` is not valid for an attention over
// q_heads query heads (window < 0; softcap negative, NaN or infinite; sinks not [q_heads] F32 or
// without data); OK otherwise. Both backends check with it.
absl::Status CheckAttentionOptions(const char* op, const AttentionOptions& options, int64_t q_heads);

// How a mixture-of-experts router turns a token's router logits over E experts into k experts and
// their weights (Backend::MoeRoute), each as transformers computes it.
enum class MoeRouter : uint8_t {
  // softmax over all E in float32, then the top k of those probabilities, divided by their sum when
  // norm_topk_prob (MixtralTopKRouter, which always divides; Qwen2MoeTopKRouter, Qwen3MoeTopKRouter).
  kSoftmaxTopK,
  // top k of the logits, then a softmax over those k (GptOssTopKRouter; its router bias is added by
  // the product that makes the logits).
  kTopKSoftmax,
  // DeepSeek-V3 (DeepseekV3TopkRouter): scores s = sigmoid(logits); choice scores c = s +
  // selection_bias (e_score_correction_bias); the E experts form n_group equal groups, each scored by
  // the sum of its two largest c; the topk_group best groups are kept and the top k of c among their
  // experts chosen; weights = s of the chosen, divided by (their sum + 1e-20) when norm_topk_prob,
  // times routed_scaling_factor.
  kSigmoidGroupTopK,
};

// Backend::MoeRoute's parameters. Checked by CheckMoeRouting.
struct MoeRouting {
  MoeRouter router = MoeRouter::kSoftmaxTopK;
  int k = 1;                     // num_experts_per_tok, in [1, E]
  bool norm_topk_prob = false;   // kSoftmaxTopK and kSigmoidGroupTopK (kTopKSoftmax's weights sum to 1)
  int n_group = 1;               // kSigmoidGroupTopK: divides E, with E / n_group >= 2
  int topk_group = 1;            // kSigmoidGroupTopK: in [1, n_group], and k <= topk_group * E / n_group
  float routed_scaling_factor = 1.0f;  // kSigmoidGroupTopK: finite
  // kSigmoidGroupTopK: null (zeros) or [E] F32 on the backend's device, added to the scores for the
  // choice only. The caller owns it; it must stay alive until the op has run.
  const Tensor* selection_bias = nullptr;
  // Round each weight to the act dtype (still stored as F32): Qwen3-MoE's router casts its weights
  // to the logits' dtype, and gpt-oss's softmax runs in it; Mixtral's and DeepSeek-V3's weights stay
  // float32. (The CPU backend's act dtype is F32: no change there.)
  bool weights_in_act = false;
};

// InvalidArgument naming `op` and the parameter when `routing` is not valid for E experts; OK
// otherwise. Both backends check with it.
absl::Status CheckMoeRouting(const char* op, const MoeRouting& routing, int64_t experts);

// The experts of one sparse layer for Backend::MoeExperts, indexed by expert id: gate_proj, up_proj
// and down_proj (packed as MatMul takes them) for at least the experts [0, end) and, where the
// family has them (gpt-oss), their biases (an expert past a bias span's end, or whose entry has no
// data, has none).
struct MoeExpertWeights {
  absl::Span<const Tensor> gate_proj, up_proj, down_proj;
  absl::Span<const Tensor> gate_bias = {}, up_bias = {}, down_bias = {};
  // gpt-oss's clamped SwiGLU (ClampedSwiGlu) when limit > 0; SiLU-gated (GateUpSilu) otherwise.
  float swiglu_alpha = 0.0f, swiglu_limit = 0.0f;
  int64_t begin = 0, end = 0;  // the experts computed: [begin, end)
};

// InvalidArgument naming `op` unless Backend::MoeExperts's arguments fit together (the weights one
// per expert, the experts within E, the rows' shapes); OK otherwise. The backends check with it.
absl::Status CheckMoeExperts(const char* op, const Tensor* out, const Tensor* gate, const Tensor* up, const Tensor& x,
                             const Tensor& offsets, const MoeExpertWeights& w);

// Multi-head latent attention's sizes (DeepSeek-V2/V3; Backend::MlaAttention).
struct MlaShape {
  int64_t heads = 0;   // this rank's query heads
  int64_t nope = 0;    // qk_nope_head_dim: each head's query and key part without RoPE
  int64_t rope = 0;    // qk_rope_head_dim: the part with RoPE (the key's shared by all heads)
  int64_t v = 0;       // v_head_dim
  int64_t latent = 0;  // kv_lora_rank
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceKind device_kind() const = 0;
  virtual DType act_dtype() const = 0;
  virtual std::string Describe() const = 0;  // e.g. "cpu (oneDNN 2.6.3, 2 threads)", "cuda:0 (H100, bf16)"
  // The host threads the math runs on (the CPU backend's OpenMP threads); 0 where a device runs it.
  virtual int compute_threads() const { return 0; }

  // ---- Memory --------------------------------------------------------------------------------
  virtual absl::StatusOr<Buffer> Allocate(size_t bytes) = 0;
  virtual void Free(void* data) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Fill0(void* dst, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;

  // Writes a slice of a counter-generated tensor (kernels/counter_uniform.h) into `out` on this
  // backend's device (F32, F16 or BF16; out_rows() x out_cols() elements): the dummy weights,
  // made where they live. Every backend writes the same bits as FillCounterUniformOnHost. The
  // base makes them on the host (directly into `out` on the CPU; through a host buffer and
  // CopyToDevice elsewhere); the CUDA backend makes them with a kernel, no host copy.
  virtual absl::Status FillCounterUniform(Tensor* out, const CounterUniformSlice& slice);

  // Kernels this backend has launched since the process started: on CUDA each of our kernel
  // launches and each cuBLAS call (counted as one, whatever cuBLAS launches inside it); 0 on the
  // CPU, which launches none. For the kernels-per-step figure (docs/gpu.md).
  virtual uint64_t kernel_launches() const { return 0; }

  // ---- Step graphs ---------------------------------------------------------------------------
  // Whether this backend can record a step's ops as a graph and replay it (CUDA graphs: the CUDA
  // backend made with CudaBackendOptions::step_graphs). The CPU backend cannot.
  virtual bool records_graphs() const { return false; }
  // Whether MoeExperts runs without reading its offsets on the host, so that a graph can record a
  // mixture-of-experts step (the base reads them: false).
  virtual bool records_moe_experts() const { return false; }
  // Between BeginGraph and EndGraph the ops called on this backend (kernels, products, CopyOnDevice
  // and Fill0) are recorded, not run, each with the arguments it was called with (tensor addresses
  // and shapes, scalars). EndGraph ends the recording, also after an op failed, and returns the
  // graph's id, or the error that spoiled it (a call that waits for the device, CopyToDevice,
  // CopyToHost or Synchronize, spoils a recording). RunGraph(id) runs the recorded ops again, in
  // order, on whatever their buffers hold then; kernel_launches() counts them as they run. The
  // base refuses all three (Unimplemented).
  virtual absl::Status BeginGraph();
  virtual absl::StatusOr<int> EndGraph();
  virtual absl::Status RunGraph(int id);

  // Device memory this backend holds to dequantize quantized weights for its products: on CUDA the
  // scratch its quantized MatMul uses above 8 rows (CudaDequantScratchBytes of the largest quantized
  // weight stored so far); 0 on the CPU, whose products read the quantized weights directly.
  virtual uint64_t dequant_scratch_bytes() const { return 0; }

  // Stores a MatMul weight w [m, k] in the layout this backend's GEMM reads fastest, once, at
  // load. Returns the buffer holding the repacked copy and sets *packed to an [m, k] tensor
  // viewing it (of the stored dtype: BF16 for CpuMatMul::kBF16), to pass to MatMul as w from then
  // on; w itself may then be freed. A packed tensor is only for MatMul, whole: other ops cannot
  // read it and MatMul refuses a view of part of it.
  // The CPU backend packs F32 weights into 16-column panels (kernels/cpu/panel_matmul.h), or for
  // bf16 products into oneDNN's blocked bf16 layout, so that each step's GEMM streams the weight
  // once instead of repacking it; a backend that reads plain weights
  // directly (CUDA) returns an empty Buffer and sets *packed = w.
  // `quant` other than kNone stores the weight quantized (kernels/quant.h; *packed is then an I8
  // view of that layout, on both backends); a backend without kernels for that format refuses with
  // Unimplemented naming it (the CUDA backend unless CudaBackendOptions::quantized_kernels).
  virtual absl::StatusOr<Buffer> PackMatMulWeight(const Tensor& w /*[m, k] act*/, Tensor* packed,
                                                  WeightQuant quant = WeightQuant::kNone);
  // A weight [m, k] already in kernels/quant.h's layout for `quant` (kInt8: Int8RowsLayout, kFp8:
  // Fp8RowsLayout{m, k, group}, kInt4: Int4GroupsLayout; host memory, layout.bytes() bytes at
  // `stored`; a published quantized checkpoint's codes and scales, model/quantized_checkpoint.h):
  // copied as it is, the same as PackMatMulWeight's own packing of such a weight, for MatMul.
  // `group`: kFp8's inputs per scale (an FP8 checkpoint's block scales; 0: one scale a row, what
  // PackMatMulWeight makes), which *packed's quant_group then says; 0 for the other formats. The
  // caller keeps `stored`. The base refuses with Unimplemented (the CUDA backend without
  // CudaBackendOptions::quantized_kernels).
  virtual absl::StatusOr<Buffer> PackQuantizedWeight(WeightQuant quant, const void* stored /*host*/, int64_t m,
                                                     int64_t k, Tensor* packed, int64_t group = 0);
  // The weights are loaded: host memory the packing kept for the next weight may go (the CUDA
  // backend's buffers for quantizing at load, the size of the largest weight: 2.5 GB of bf16 for
  // Qwen2.5-72B's LM head). A later PackMatMulWeight grows them again. ModelShard::Load calls it
  // last. The base has nothing to release.
  virtual void ReleaseLoadBuffers() {}

  // A tied embedding and LM head on one stage is one buffer: its table w [rows, d] (act), packed
  // where the backend has a layout that both Embedding and MatMul read: the CPU backend's float32
  // panels (kernels/cpu/panel_matmul.h) whatever its products' dtype (the table is float32 either
  // way), from which Embedding gathers the few rows a step looks up, where the LM head's product
  // would read a plain table at half speed up to 3 rows and repack it on every call from 4. The
  // base (CUDA, whose kernels read plain tables) returns an empty Buffer and sets *packed = w.
  virtual absl::StatusOr<Buffer> PackTiedTable(const Tensor& w /*[rows, d] act*/, Tensor* packed) {
    *packed = w;
    return Buffer();
  }

  // ---- Ops -----------------------------------------------------------------------------------
  // Vocab-parallel embedding: this shard holds rows [row_offset, row_offset + rows) of the table.
  // Ids outside that range give zero rows (the all-reduce across shards fills them in). Ids below
  // 0 or at/above vocab_size are an error the caller checks before the step. The table is plain,
  // or as PackTiedTable made it.
  virtual absl::Status Embedding(Tensor* out /*[n, d] act*/, const Tensor& table /*[rows, d] act*/,
                                 const Tensor& ids /*[n] i32*/, int64_t row_offset) = 0;

  // out = x / sqrt(mean(x^2) + eps) * w, computed in float32. out may alias x (per-head q/k norms
  // run in place).
  virtual absl::Status RmsNorm(Tensor* out /*[n, d] act*/, const Tensor& x /*[n, d] act*/,
                               const Tensor& w /*[d] act*/, float eps) = 0;

  // x = x + y (the residual add, rounded to act as Add rounds), then normed = RmsNorm(x, w, eps):
  // Add and RmsNorm in one call, which a backend may do in one pass over each row. The base calls
  // Add, then RmsNorm; the CUDA backend with CudaBackendOptions::fused_kernels runs one kernel that
  // gives the same bits. normed may alias y.
  virtual absl::Status AddRmsNorm(Tensor* x /*[n, d] act*/, const Tensor& y /*[n, d] act*/,
                                  Tensor* normed /*[n, d] act*/, const Tensor& w /*[d] act*/, float eps);

  // out = x @ w^T (+ bias): w is stored as in Hugging Face Linear, [out_features, in_features],
  // plain or as PackMatMulWeight made it. out may be F32 (logits) or act. bias may be null.
  virtual absl::Status MatMul(Tensor* out /*[n, m]*/, const Tensor& x /*[n, k] act*/,
                              const Tensor& w /*[m, k] act*/, const Tensor* bias /*[m] act*/) = 0;

  // MatMul(product.out, x, *product.w, product.bias) for each product of one input x (a layer's q,
  // k and v; gate and up), the same bits, which a backend may compute together. The base calls
  // MatMul for each in order, stopping at the first error; the CUDA backend runs up to three
  // decode products by act-dtype weights as one dense GEMV launch (kernels/cuda/gemv.cu).
  virtual absl::Status MatMuls(const Tensor& x /*[n, k] act*/, absl::Span<const MatMulProduct> products);

  // Rotary embedding in place, Hugging Face "rotate_half" layout: for each head, the pair
  // (x[i], x[i + rd/2]) is rotated by angle pos * inv_freq[i] (rd = options.rotary_dim, the whole
  // head by default; cos and sin times options.attention_factor; LongRoPE's long_inv_freq from
  // options.long_from on). Both q and k are required.
  virtual absl::Status Rope(Tensor* q /*[n, q_heads * hd] act*/, Tensor* k /*[n, kv_heads * hd] act*/,
                            const Tensor& positions /*[n] i32*/, const Tensor& inv_freq /*[rd/2] f32*/,
                            int head_dim, const RopeOptions& options) = 0;

  // Writes each token's k and v into its cache slot.
  virtual absl::Status CacheWrite(Tensor* k_cache /*[blocks, bs, kv_heads, hd] act*/,
                                  Tensor* v_cache /*[blocks, bs, kv_heads, hd] act*/,
                                  const Tensor& k /*[n, kv_heads * hd] act*/,
                                  const Tensor& v /*[n, kv_heads * hd] act*/,
                                  const Tensor& slots /*[n] i32*/) = 0;

  // Rope(q, k, ...), then CacheWrite(k_cache, v_cache, k, v, slots): a layer's rotary embedding
  // and the write of its rotated keys and its values into the cache, which a backend may do in one
  // pass. The base calls the two; the CUDA backend with CudaBackendOptions::fused_kernels runs
  // one kernel that gives the same bits.
  virtual absl::Status RopeCacheWrite(Tensor* q /*[n, q_heads * hd] act*/, Tensor* k /*[n, kv_heads * hd] act*/,
                                      const Tensor& v /*[n, kv_heads * hd] act*/, const Tensor& positions /*[n] i32*/,
                                      const Tensor& inv_freq /*[rd/2] f32*/, int head_dim,
                                      const RopeOptions& options,
                                      Tensor* k_cache /*[blocks, bs, kv_heads, hd] act*/,
                                      Tensor* v_cache /*[blocks, bs, kv_heads, hd] act*/,
                                      const Tensor& slots /*[n] i32*/);

  // Causal attention with GQA over the paged cache. Token t of sequence s = token_seq[t] at
  // position p = positions[t] attends to positions 0..p of s (which must already be in the
  // cache). Query head h reads kv head h / (q_heads / kv_heads). Covers prefill (many tokens of
  // a sequence) and decode (one token) in the same call. head_dim <= 512 on CUDA. `options` adds a
  // sliding window, logit soft-capping and attention sinks (AttentionOptions).
  virtual absl::Status Attention(Tensor* out /*[n, q_heads * hd] act*/, const Tensor& q /*[n, q_heads * hd] act*/,
                                 const Tensor& k_cache /*[blocks, bs, kv_heads, hd] act*/,
                                 const Tensor& v_cache /*[blocks, bs, kv_heads, hd] act*/,
                                 const Tensor& positions /*[n] i32*/, const Tensor& token_seq /*[n] i32*/,
                                 const Tensor& block_tables /*[seqs, max_blocks] i32*/, float scale,
                                 const AttentionOptions& options = {}) = 0;

  // Multi-head latent attention over a latent cache, its projections absorbed (DeepSeek-V2/V3's
  // MLA). First each token's cache row [kv_c | k_pe] (its normed latent and its roped RoPE key) is
  // written into its slot. Then token t of sequence s at position p attends to positions 0..p of
  // s (as Attention does) with each head h of kv_b (this rank's rows: per head, nope rows W_UK_h,
  // then v rows W_UV_h, each [., latent]):
  //   q_latent = W_UK_h^T q_nope_h;  score_j = (q_latent . c_j + q_pe_h . k_pe_j) * scale
  //   out_h = W_UV_h (sum_j softmax(score)_j c_j)
  // which is transformers' attention over the decompressed keys [W_UK_h c_j | k_pe_j] and values
  // W_UV_h c_j, up to float rounding. The base refuses (Unimplemented): only the CPU backend has it.
  virtual absl::Status MlaAttention(Tensor* out /*[n, heads * v] act*/, const Tensor& q_nope /*[n, heads * nope] act*/,
                                    const Tensor& q_pe /*[n, heads * rope] act*/, const Tensor& kv_c /*[n, latent] act*/,
                                    const Tensor& k_pe /*[n, rope] act*/,
                                    const Tensor& kv_b /*[heads * (nope + v), latent] act*/,
                                    Tensor* cache /*[blocks, bs, 1, latent + rope] act*/, const Tensor& slots /*[n] i32*/,
                                    const Tensor& positions /*[n] i32*/, const Tensor& token_seq /*[n] i32*/,
                                    const Tensor& block_tables /*[seqs, max_blocks] i32*/, float scale,
                                    const MlaShape& shape);

  // SwiGLU: out = silu(gate) * up (out may alias gate or up).
  virtual absl::Status SiluMul(Tensor* out /*[n, f] act*/, const Tensor& gate /*[n, f] act*/,
                               const Tensor& up /*[n, f] act*/) = 0;

  // SwiGLU's products and its SiLU: MatMuls(x, {{gate, gate_w}, {up, up_w}}), then SiluMul(gate,
  // gate, up): gate ends as silu(x @ gate_w^T) x (x @ up_w^T), each product rounded to gate's dtype
  // first; up is scratch (its contents afterwards unspecified). The base calls the two; the CUDA
  // backend with CudaBackendOptions::fused_kernels computes a row of each in one block of the dense
  // GEMV and writes silu x up from there: the same bits, one launch and no pass over gate and up.
  virtual absl::Status GateUpSilu(Tensor* gate /*[n, f] act*/, Tensor* up /*[n, f] act*/,
                                  const Tensor& x /*[n, k] act*/, const Tensor& gate_w /*[f, k] act*/,
                                  const Tensor& up_w /*[f, k] act*/);

  // gpt-oss's clamped SwiGLU (GptOssExperts._apply_gate): g = min(gate, limit), u = clamp(up, -limit,
  // limit), out = (u + 1) * (g * sigmoid(alpha * g)), computed in float32 in transformers' order and
  // rounded to act once (out may alias gate or up). alpha and limit finite and > 0 (InvalidArgument
  // otherwise). The base refuses (Unimplemented); the CPU and CUDA backends have it.
  virtual absl::Status ClampedSwiGlu(Tensor* out /*[n, f] act*/, const Tensor& gate /*[n, f] act*/,
                                     const Tensor& up /*[n, f] act*/, float alpha, float limit);

  // GeGLU with the tanh GELU (Gemma, Gemma 2 and 3's MLP: transformers' gelu_pytorch_tanh, then
  // "* up"): out = gelu_tanh(gate) * up, with gelu_tanh(x) = 0.5 * x * (1 + tanh(sqrt(2 / pi) *
  // (x + 0.044715 * x^3))), PyTorch's gelu(approximate="tanh"), computed in float32 in PyTorch's
  // order of operations and rounded to act once (out may alias gate or up).
  virtual absl::Status GeluTanhMul(Tensor* out /*[n, f] act*/, const Tensor& gate /*[n, f] act*/,
                                   const Tensor& up /*[n, f] act*/) = 0;

  // out = x * factor, each product in float32 rounded to act once (out may alias x). Gemma's
  // embedding normalizer: transformers multiplies the embeddings, in the hidden dtype, by
  // torch.tensor(hidden_size ** 0.5, dtype=hidden.dtype), so the caller passes the factor already
  // rounded to the act dtype (sqrt(3072) is 55.4256 in float32, 55.5 in bfloat16); this op does not
  // round it.
  virtual absl::Status Scale(Tensor* out /*[n, d] act*/, const Tensor& x /*[n, d] act*/, float factor) = 0;

  // Logit soft-capping in place (Gemma 2's final_logit_softcapping): x = cap * tanh(x / cap) in
  // float32, in transformers' order (divide, tanh, multiply). cap must be > 0 and finite
  // (InvalidArgument otherwise).
  virtual absl::Status Softcap(Tensor* x /*[n, v] f32*/, float cap) = 0;

  // out = a + b (out may alias a or b).
  virtual absl::Status Add(Tensor* out /*[n, d] act*/, const Tensor& a /*[n, d] act*/,
                           const Tensor& b /*[n, d] act*/) = 0;

  // ---- Mixture-of-experts steps (router logits -> experts and weights -> tokens grouped by expert
  // -> the experts' products (MoeExperts) -> weighted combine). The base refuses each with
  // Unimplemented but MoeExperts; the CPU and CUDA backends implement them.

  // Per token (row of logits, float32 or the act dtype, which is widened to float32 as
  // softmax(router_logits, dtype=float) does), the k experts `routing` chooses and their weights, in
  // top-k order: larger selection value first, and on equal values the lower expert id first
  // (docs/kernels.md says how that compares with torch.topk). Every logit must be finite: the CPU
  // backend refuses a NaN or infinite one with InvalidArgument naming its row and column; the CUDA
  // backend writes ids -1 and weights 0 for that row and reports it at the next Synchronize(). So
  // does a NaN selection bias.
  virtual absl::Status MoeRoute(Tensor* ids /*[n, k] i32*/, Tensor* weights /*[n, k] f32*/,
                                const Tensor& logits /*[n, E] f32 or act*/, const MoeRouting& routing);

  // The (token, slot) pairs p = token * k + slot of `ids` grouped by expert: order[offsets[e] ..
  // offsets[e + 1]) lists expert e's pairs in increasing p (a stable counting sort), offsets[0] = 0,
  // offsets[E] = n * k, and rows[token, slot] is where that pair sits in order (the inverse
  // permutation): the row of the grouped products' output that MoeCombine reads for it. Ids must be
  // in [0, E) (the CPU backend refuses others; the CUDA backend skips them, leaving their rows -1,
  // and reports them at the next Synchronize()). tokens, where not null, gets each grouped pair's
  // token, order[i] / k: the rows of the layer's input the experts read. n * k < 2^31.
  virtual absl::Status MoeGroupByExpert(Tensor* order /*[n * k] i32*/, Tensor* rows /*[n, k] i32*/,
                                        Tensor* offsets /*[E + 1] i32*/, Tensor* tokens /*[n * k] i32 or null*/,
                                        const Tensor& ids /*[n, k] i32*/);

  // counts[e] += offsets[e + 1] - offsets[e] for e in [begin, end): the rows each expert got, summed
  // over a step's layers on the device (the worker reads them after the step). Offsets must be
  // nondecreasing (the CPU backend refuses others; the CUDA backend adds nothing for such an
  // expert and reports it at the next Synchronize()).
  virtual absl::Status MoeCountRows(Tensor* counts /*[E] i32*/, const Tensor& offsets /*[E + 1] i32*/,
                                    int64_t begin, int64_t end);

  // The experts' MLPs on rows grouped by expert (MoeGroupByExpert's order): for each expert e in
  // [w.begin, w.end), its rows [offsets[e], offsets[e + 1]) of x give out's same rows,
  // down_proj(act(gate_proj(x), up_proj(x))), act SiLU-gated (GateUpSilu) or gpt-oss's clamped
  // SwiGLU with the biases (ClampedSwiGlu); rows of other experts are left as they are. gate and up
  // are scratch of x's rows. offsets is device memory (written by the step's ops), nondecreasing,
  // offsets[end] at most x's rows (InvalidArgument otherwise; where the offsets are read on the
  // device, at the next Synchronize()). The base reads offsets on the host and runs each expert that
  // has rows as the ops named (records_moe_experts() is false); the CUDA backend with
  // CudaBackendOptions::moe_grouped runs one grouped GEMV instead.
  virtual absl::Status MoeExperts(Tensor* out /*[rows, d] act*/, Tensor* gate /*[rows, f] act*/,
                                  Tensor* up /*[rows, f] act*/, const Tensor& x /*[rows, h] act*/,
                                  const Tensor& offsets /*[E + 1] i32*/, const MoeExpertWeights& w);

  // Qwen2-MoE's gated shared expert: out[t] = x[t] * sigmoid(gate[t]), the sigmoid taken in float32
  // and rounded to act, then the product rounded to act (transformers' F.sigmoid(shared_expert_gate(
  // h)) * shared_expert_output in the hidden dtype). out may alias x.
  virtual absl::Status SigmoidGateMul(Tensor* out /*[n, d] act*/, const Tensor& x /*[n, d] act*/,
                                      const Tensor& gate /*[n, 1] act*/);

  // out[t] = sum over the token's k slots of weights[t, s] * expert_out[rows[t, s]], as
  // transformers' experts loop computes it: out starts at zero and, slot by slot in increasing row
  // (for rows from MoeGroupByExpert: increasing expert id, transformers' expert order), each product
  // is taken in float32 and rounded to act, then added to out and the sum rounded to act (index_add_
  // in the hidden dtype). Rows must be in [0, expert_rows) (refused on the CPU; skipped and reported
  // at the next Synchronize() on CUDA). out must not alias expert_out.
  virtual absl::Status MoeCombine(Tensor* out /*[n, d] act*/, const Tensor& expert_out /*[expert_rows, d] act*/,
                                  const Tensor& rows /*[n, k] i32*/, const Tensor& weights /*[n, k] f32*/);

  // Row-wise softmax of x / temperature.
  virtual absl::Status Softmax(Tensor* out /*[n, v] f32*/, const Tensor& x /*[n, v] f32*/, float temperature) = 0;

  // Index of the largest logit per row (the first one on ties, as torch.argmax).
  virtual absl::Status Argmax(Tensor* out /*[n] i32 host or device*/, const Tensor& logits /*[n, v] f32*/) = 0;

  // out[r] = 1 when every logit of row r is finite, 0 when one is NaN or an infinity (a model that
  // overflowed: the sampler reports such a row instead of choosing from it).
  virtual absl::Status FiniteRows(Tensor* out /*[n] i32 host or device*/, const Tensor& logits /*[n, v] f32*/) = 0;

  // Samples one id per row from softmax(logits / temperature) restricted by top_k, then top_p
  // (measured on the top-k renormalized mass). `out` may be host or device memory.
  // Among the kept tokens (in vocabulary order) it returns the first whose cumulative
  // renormalized probability exceeds uniform, so one draw gives one answer on every backend.
  // A -inf logit is a masked token (probability 0, never returned); a row needs one finite logit.
  virtual absl::Status Sample(Tensor* out /*[n] i32*/, const Tensor& logits /*[n, v] f32*/,
                              const std::vector<SampleParams>& params /*[n], host*/) = 0;
};

// How the CPU backend multiplies by packed weights (PackMatMulWeight). kF32: in float32, which
// matches Hugging Face's float32 CPU reference. kBF16: the packed weights are stored in bfloat16
// (half the memory) and each product rounds its input rows to bfloat16 and accumulates in float32
// (oneDNN's AMX or AVX-512 BF16 kernels; about 3 significant digits per input, so logits differ
// from float32 ones by ~1e-2). Activations stay float32 either way, and plain (unpacked) weights
// are always multiplied in float32.
enum class CpuMatMul : uint8_t { kF32, kBF16 };

// The CPU backend: float32 activations; float32 products in its own loops, bf16 ones in oneDNN. Never fails to create (a CPU
// without bfloat16 support in oneDNN fails at PackMatMulWeight, saying so). threads > 0: matrix
// products and the heavier loops (attention, SiluMul) run on that many (OpenMP) threads; threads
// <= 0: on OpenMP's default (OMP_NUM_THREADS, else one per core). The backend's other ops run on
// the calling thread.
std::unique_ptr<Backend> MakeCpuBackend(int threads = 0, CpuMatMul matmul = CpuMatMul::kF32);

// Whether the CPU backend rounds the input rows of its products by int8 and int4 weights to
// integers (worker --activation-quantization; its default, auto, is DefaultCpuActivationQuant).
// kNone: those products multiply the float32 inputs by the exactly widened weights, and equal the
// dequantized weights' float32 product up to float32 rounding. kInt8: each input row is rounded to
// int8 with one scale (max |x| / 127) and multiplied in integers (AVX-512 VNNI's VPDPBUSD, else
// AVX2's VPMADDUBSW), as llama.cpp's Q8_0 / Q4_0 products do: faster, and each input moves by up to
// 1/254 of its row's largest
// (tests/llama_parity_test.cc states what that does to the logits). kInt16: int4 weights only, each
// input row rounded to int16 per group of 128 (max |x| / 32767 a group) and multiplied in integers
// (AVX-512 VNNI's VPDPWSSD, two inputs an instruction: kernels/cpu/panel_matmul.h
// PanelMatMulInt4Act16), each input moving by up to 1/65534 of its group's largest; int8 weights stay
// exact. fp8 and MXFP4 weights, float32 and bf16 products are unaffected by either.
enum class CpuActivationQuant : uint8_t { kNone, kInt8, kInt16 };

// --activation-quantization auto: kInt16 on a CPU with AVX-512 VNNI (int4 weights' products 1.1x to
// 2.4x faster there, their logits ~1e-3 from the exact ones: docs/quantization.md), else kNone.
CpuActivationQuant DefaultCpuActivationQuant();
// "auto" (DefaultCpuActivationQuant), "none", "int8" or "int16"; InvalidArgument naming the value
// otherwise.
absl::StatusOr<CpuActivationQuant> ParseCpuActivationQuant(const std::string& name);
const char* CpuActivationQuantName(CpuActivationQuant act);

// MakeCpuBackend with `act`. kInt8 needs AVX-512 VNNI or AVX2 (kernels/cpu/quant_isa.h
// Int8ActivationsIsa), kInt16 AVX-512 VNNI: on a CPU without them this is FailedPrecondition naming
// what the CPU has, rather than a silent fall back to the exact products. InvalidArgument when
// ONEDNN_MAX_CPU_ISA (the cap on the instruction sets of oneDNN and of the CPU backend's own
// products: kernels/cpu/isa_cap.h) holds a value oneDNN does not know.
absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(int threads, CpuMatMul matmul, CpuActivationQuant act);

// Whether oneDNN multiplies bf16 on this CPU with bf16 instructions (AVX512-BF16 or AMX; within any
// DNNL_MAX_CPU_ISA cap). Without them CpuMatMul::kBF16 may still work on AVX-512 (emulated, no
// faster than float32) or fail (older CPUs).
bool CpuHasNativeBf16MatMul();

// The default of CudaBackendOptions::quantized_scratch_bytes: at most this much device memory holds a
// quantized weight's rows dequantized to the act dtype (a single row larger than it is taken whole).
inline constexpr uint64_t kCudaDequantScratchBytes = uint64_t{64} << 20;

// The rows of a quantized weight [m, k] (m, k > 0) the CUDA backend's MatMul dequantizes at a time
// (activations of `act`): as many whole rows as fit in `limit` bytes, at least one, at most m.
int64_t CudaDequantBlockRows(int64_t m, int64_t k, DType act, uint64_t limit = kCudaDequantScratchBytes);

// The dequantize scratch that MatMul needs for such a weight: CudaDequantBlockRows of it, rounded up
// to a power of two, at least 64 bytes. A power of two, so that the scratch grown weight after
// weight (doubling, CudaBackend::GrowDevice) ends exactly at the largest of them. The backend grows
// its scratch to this as it stores each quantized weight (at load: no step allocates it), and
// reports the total (Backend::dequant_scratch_bytes); the planner counts the largest over a worker's
// quantized weights (coordinator/planner/memory.h). One function for both, so that they agree.
uint64_t CudaDequantScratchBytes(int64_t m, int64_t k, DType act, uint64_t limit = kCudaDequantScratchBytes);

// Number of CUDA devices usable by this build (0 when built without CUDA or none present).
int CudaDeviceCount();
// Device `ordinal`'s compute capability as 10 x major + minor (90: Hopper); 0 when built without
// CUDA or no such device.
int CudaComputeCapability(int ordinal);

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_BACKEND_H_
