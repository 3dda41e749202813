// Quantized tensor contents from a hostile checkpoint (model/quantized_checkpoint.h): the tensors
// of one quantized linear layer (GPTQ qweight / qzeros / scales / g_idx, AWQ's, compressed-tensors'
// weight_packed / weight_scale / weight_zero_point / weight_shape, FP8's weight / weight_scale_inv)
// with the names, dtypes and shapes of a real layer of one of the quantized fixtures
// (tests/fixtures/{gptq,awq,compressed_tensors,fp8}, loaded once) and contents from the input,
// written as a safetensors file, opened by Checkpoint::Open and read by ReadQuantizedLinear as a
// worker reads it (its quantization_config parsed from the fixture's config.json).
//
// Input: byte 0 picks the fixture; byte 1: bit 0 the layer (q_proj or gate_proj, sliced by
// outputs, or down_proj or o_proj, sliced by inputs: layer 0's first that the fixture quantizes), bits 1-2 the slice (whole, first half, second half: a TP 2 rank's),
// bit 3 whether to map onto a kernel layout; the rest overwrites the layer's data bytes from the
// start (smallest tensor first; bytes past the input keep the fixture's values).
//
// Invariants: any contents give a Status or a slice of the asked size whose weights are all finite;
// a slice held in a kernel layout (int4 groups, int8 or fp8 rows) dequantizes to exactly the
// float32 weights the dequantized path computes from the same bytes.
//
// Seeds: SHARDSERVE_FUZZ_WRITE_SEEDS=DIR quantized_linear_fuzzer writes, for every fixture and
// layer, the input that reproduces the fixture's own bytes.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "fuzz/check.h"
#include "fuzz/scratch_checkpoint.h"
#include "fuzz/seeds.h"
#include "kernels/quant.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/quantized_checkpoint.h"
#include "model/weight_source.h"

namespace {

using shardserve_fuzz::AllFinite;
using shardserve_fuzz::Check;
using shardserve_fuzz::MakeScratchDir;
using shardserve_fuzz::ReadFileBytes;
using shardserve_fuzz::SafetensorsFile;
using shardserve_fuzz::WriteSafetensors;
using shardserve_fuzz::WriteSeedsIfAsked;

namespace fs = std::filesystem;
using shardserve::QuantizedLinearSlice;
using shardserve::TensorInfo;

// One quantized linear layer of a fixture: its tensors' entries, smallest first, and their bytes.
struct Layer {
  std::string prefix;
  int64_t out = 0, in = 0;
  int dim = 0;  // the dimension a TP rank's slice cuts: 0 outputs (q_proj), 1 inputs (down_proj)
  std::vector<TensorInfo> tensors;
  std::vector<std::string> bytes;
};

struct Fixture {
  std::string name;
  shardserve::CheckpointQuant quant;
  Layer layers[2];
};

const std::vector<Fixture>& Fixtures() {
  static const std::vector<Fixture>* fixtures = [] {
    auto* out = new std::vector<Fixture>();
    const fs::path root = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures";
    std::vector<fs::path> dirs;
    for (const char* format : {"gptq", "awq", "compressed_tensors", "fp8"}) {
      for (const fs::directory_entry& e : fs::directory_iterator(root / format)) {
        if (fs::exists(e.path() / "config.json")) dirs.push_back(e.path());
      }
    }
    std::sort(dirs.begin(), dirs.end());  // a fixed order: byte 0 means the same fixture every run
    for (const fs::path& dir : dirs) {
      absl::StatusOr<shardserve::ModelConfig> config = shardserve::LoadModelConfig(dir);
      absl::StatusOr<std::unique_ptr<shardserve::Checkpoint>> ckpt = shardserve::Checkpoint::Open(dir);
      Check(config.ok() && ckpt.ok() && config->checkpoint_quant.has_value(), "a fixture that does not load");
      // The mixture-of-experts fixtures hold their MLPs as experts, read by the same readers as a
      // dense module of their format; the dense fixtures of each format are the ones fuzzed.
      if (config->num_experts > 0) continue;
      Fixture f;
      f.name = dir.parent_path().filename().string() + "_" + dir.filename().string();
      f.quant = *config->checkpoint_quant;
      const int64_t h = config->hidden_size, i = config->intermediate_size;
      // Layer 0's first quantized module sliced by outputs, and by inputs (a fixture may store
      // some modules plain: compressed-tensors' ignore list).
      const Layer by_outputs[] = {{"model.layers.0.self_attn.q_proj", config->q_dim(), h, 0, {}, {}},
                                  {"model.layers.0.mlp.gate_proj", i, h, 0, {}, {}}};
      const Layer by_inputs[] = {{"model.layers.0.mlp.down_proj", h, i, 1, {}, {}},
                                 {"model.layers.0.self_attn.o_proj", h, config->q_dim(), 1, {}, {}}};
      for (int d = 0; d < 2; ++d) {
        for (const Layer& l : d == 0 ? by_outputs : by_inputs) {
          if (f.layers[d].prefix.empty() && f.quant.Quantizes(l.prefix)) f.layers[d] = l;
        }
        Check(!f.layers[d].prefix.empty(), "a fixture without a quantized module to read");
      }
      for (Layer& layer : f.layers) {
        for (const auto& [name, info] : (*ckpt)->tensors()) {
          if (name.rfind(layer.prefix + ".", 0) == 0) layer.tensors.push_back(info);
        }
        Check(!layer.tensors.empty(), "a fixture layer without tensors");
        std::sort(layer.tensors.begin(), layer.tensors.end(),
                  [](const TensorInfo& a, const TensorInfo& b) { return a.nbytes < b.nbytes; });
        for (const TensorInfo& t : layer.tensors) layer.bytes.push_back(ReadFileBytes(dir / t.file, t.offset, t.nbytes));
      }
      out->push_back(std::move(f));
    }
    return out;
  }();
  return *fixtures;
}

// The checkpoint each input becomes: the layer's tensors with their data bytes overwritten by
// `contents` from the start.
std::string LayerFile(const Layer& layer, const uint8_t* contents, size_t n) {
  std::string data;
  for (const std::string& b : layer.bytes) data += b;
  std::copy(contents, contents + std::min(n, data.size()), data.begin());
  return SafetensorsFile(layer.tensors, data);
}

void WriteSeeds(const std::string& dir) {
  const std::vector<Fixture>& fixtures = Fixtures();
  for (size_t f = 0; f < fixtures.size(); ++f) {
    for (int l = 0; l < 2; ++l) {
      std::string input{static_cast<char>(f), static_cast<char>(l | 8)};
      for (const std::string& b : fixtures[f].layers[l].bytes) input += b;
      const std::string& prefix = fixtures[f].layers[l].prefix;
      std::ofstream(dir + "/" + fixtures[f].name + "_" + prefix.substr(prefix.rfind('.') + 1), std::ios::binary) << input;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Fixtures();
  WriteSeedsIfAsked(WriteSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const std::vector<Fixture>& fixtures = Fixtures();
  const Fixture& f = fixtures[data[0] % fixtures.size()];
  const Layer& layer = f.layers[data[1] & 1];
  const bool map = (data[1] & 8) != 0;
  const int64_t extent = layer.dim == 0 ? layer.out : layer.in;
  const shardserve::Slice slices[3] = {{layer.dim, 0, -1}, {layer.dim, 0, extent / 2}, {layer.dim, extent / 2, -1}};
  const shardserve::Slice slice = slices[((data[1] >> 1) & 3) % 3];
  static const fs::path scratch = MakeScratchDir();
  WriteSafetensors(scratch, LayerFile(layer, data + 2, size - 2));
  absl::StatusOr<std::unique_ptr<shardserve::Checkpoint>> ckpt = shardserve::Checkpoint::Open(scratch);
  Check(ckpt.ok(), "the layer's own header refused");
  // The shapes are the fixture's; only compressed-tensors' weight_shape values may disagree.
  if (const absl::Status s = shardserve::CheckQuantizedLinear(**ckpt, f.quant, layer.prefix, layer.out, layer.in);
      !s.ok()) {
    std::fprintf(stderr, "quantized_linear_fuzzer: %s\n", s.ToString().c_str());
    std::abort();
  }
  absl::StatusOr<QuantizedLinearSlice> w =
      shardserve::ReadQuantizedLinear(**ckpt, f.quant, layer.prefix, layer.out, layer.in, slice, map);
  if (!w.ok()) {
    Check(!w.status().message().empty(), "a refusal that says nothing");
    return 0;
  }
  const int64_t end = slice.end < 0 ? extent : slice.end;
  const int64_t m = layer.dim == 0 ? end - slice.begin : layer.out, k = layer.dim == 1 ? end - slice.begin : layer.in;
  Check(w->m == m && w->k == k, "a slice of another size");
  if (w->kernel == shardserve::WeightQuant::kNone) {
    Check(static_cast<int64_t>(w->dense.size()) == m * k, "dense weights of another size");
    Check(AllFinite(w->dense), "a weight that is not finite");
    return 0;
  }
  Check(map, "a kernel layout asked not to map");
  absl::StatusOr<QuantizedLinearSlice> dense =
      shardserve::ReadQuantizedLinear(**ckpt, f.quant, layer.prefix, layer.out, layer.in, slice, /*map=*/false);
  Check(dense.ok(), "the dequantized path refuses what the kernel layout took");
  Check(AllFinite(dense->dense), "a weight that is not finite");
  std::vector<float> back(static_cast<size_t>(m * k));
  switch (w->kernel) {
    case shardserve::WeightQuant::kInt4:
      Check(static_cast<int64_t>(w->blocks.size()) == m * ((k + shardserve::kInt4GroupSize - 1) / shardserve::kInt4GroupSize),
            "int4 blocks of another size");
      shardserve::DequantizeInt4Groups(back.data(), w->blocks.data(), m, k);
      break;
    case shardserve::WeightQuant::kInt8:
    case shardserve::WeightQuant::kFp8: {
      Check(w->group == 0 || w->kernel == shardserve::WeightQuant::kFp8, "input groups on int8 rows");
      Check(static_cast<int64_t>(w->rows.size()) == shardserve::Fp8RowsLayout{m, k, w->group}.bytes(),
            "rows of another size");
      if (w->kernel == shardserve::WeightQuant::kInt8) {
        shardserve::DequantizeInt8Rows(back.data(), w->scales(), reinterpret_cast<const int8_t*>(w->codes()), m, k);
      } else {
        shardserve::DequantizeFp8Groups(back.data(), w->scales(), w->codes(), m, k, w->group);
      }
      break;
    }
    default:
      Check(false, "an unknown kernel layout");
  }
  Check(back == dense->dense, "the kernel layout dequantizes to other weights than the dequantized path");
  return 0;
}
