// MXFP4 expert contents from a hostile checkpoint (model/mxfp4.h): one expert's E8M0 scales and
// e2m1 code blocks of the gpt-oss fixture (tests/fixtures/models/gpt_oss_mxfp4_tf5, layer 0's
// gate_up_proj or down_proj: <name>_blocks U8 [E, out, in / 32, 16] and <name>_scales U8
// [E, out, in / 32]) with contents from the input, written as a safetensors file, opened by
// Checkpoint::Open and read as the worker's loader reads an expert (worker/shard/loader.cc): its
// blocks and scales by expert, then the rows and blocks of one rank turned into each layout the
// loader may hold them in.
//
// Input: byte 0: bit 0 the product (gate_up_proj or down_proj), bits 1-3 the expert (modulo the
// fixture's 5), bits 4-5 the slice (whole, first half, second half: a TP 2 rank's; gate_up_proj's
// rows of the gate or the up, down_proj's inputs), bit 6 gate_up_proj's gate or up (its rows are
// interleaved: the gate's the even ones); the rest overwrites that expert's scales, then its
// blocks, from the start (bytes past the input keep the fixture's values).
//
// Invariants: the expert reads back; DequantizeMxfp4 gives finite weights or an error naming the
// tensor, and refuses only where a block holds a value past float32 (kernels/quant.h
// Mxfp4BlockFinite); Mxfp4Rows takes the slice exactly when every block of it is finite, and then
// its bytes are finite by Mxfp4ValuesFinite and dequantize (the kernels' reference
// DequantizeMxfp4Rows) to exactly DequantizeMxfp4's weights of the same rows and blocks, and
// Mxfp4AsFp8Groups takes it as well and its fp8 layout dequantizes to those same weights.
//
// Seeds: SHARDSERVE_FUZZ_WRITE_SEEDS=DIR mxfp4_experts_fuzzer writes, for each product and slice,
// the input that reproduces an expert's own bytes, and variants with the edge scales 253, 254, 255.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
#include "model/mxfp4.h"
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
using shardserve::kMxfp4BlockBytes;
using shardserve::kMxfp4BlockSize;
using shardserve::TensorInfo;

// One stacked expert product of the fixture: its tensors (scales, then blocks) and their bytes.
struct Product {
  std::string name;                          // e.g. model.layers.0.mlp.experts.down_proj
  int64_t experts = 0, out = 0, groups = 0;  // blocks [experts, out, groups, 16]
  TensorInfo tensors[2];                     // <name>_scales, <name>_blocks
  std::string bytes[2];
  int64_t expert_bytes(int t) const { return out * groups * (t == 0 ? 1 : kMxfp4BlockBytes); }
};

const std::vector<Product>& Products() {
  static const std::vector<Product>* products = [] {
    auto* out = new std::vector<Product>();
    const fs::path dir = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/gpt_oss_mxfp4_tf5";
    absl::StatusOr<shardserve::ModelConfig> config = shardserve::LoadModelConfig(dir);
    absl::StatusOr<std::unique_ptr<shardserve::Checkpoint>> ckpt = shardserve::Checkpoint::Open(dir);
    Check(config.ok() && ckpt.ok() && config->mxfp4_experts, "the fixture does not load as MXFP4 experts");
    for (const char* part : {"gate_up_proj", "down_proj"}) {
      Product p;
      p.name = std::string("model.layers.0.mlp.experts.") + part;
      int t = 0;
      for (const char* suffix : {"_scales", "_blocks"}) {
        const auto it = (*ckpt)->tensors().find(p.name + suffix);
        Check(it != (*ckpt)->tensors().end(), "the fixture lacks an expert tensor");
        p.tensors[t] = it->second;
        p.bytes[t] = ReadFileBytes(dir / it->second.file, it->second.offset, it->second.nbytes);
        ++t;
      }
      const std::vector<int64_t>& shape = p.tensors[1].shape;
      Check(shape.size() == 4 && shape[3] == kMxfp4BlockBytes && p.tensors[0].shape.size() == 3,
            "the fixture's blocks and scales are not MXFP4's shapes");
      p.experts = shape[0];
      p.out = shape[1];
      p.groups = shape[2];
      out->push_back(std::move(p));
    }
    return out;
  }();
  return *products;
}

// The checkpoint each input becomes: `p`'s tensors with expert `e`'s scales, then its blocks,
// overwritten by `contents`.
std::string ProductFile(const Product& p, int64_t e, const uint8_t* contents, size_t n) {
  std::string data;
  for (int t = 0; t < 2; ++t) {
    std::string bytes = p.bytes[t];
    const size_t take = std::min<size_t>(n, static_cast<size_t>(p.expert_bytes(t)));
    std::copy(contents, contents + take, bytes.begin() + e * p.expert_bytes(t));
    contents += take;
    n -= take;
    data += bytes;
  }
  return SafetensorsFile({p.tensors[0], p.tensors[1]}, data);
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void WriteSeeds(const std::string& dir) {
  const std::vector<Product>& products = Products();
  for (size_t p = 0; p < products.size(); ++p) {
    const Product& product = products[p];
    for (int slice = 0; slice < 3; ++slice) {
      for (int up = 0; up < (p == 0 ? 2 : 1); ++up) {
        const int64_t e = (slice + up) % product.experts;
        std::string input{static_cast<char>(p | (e << 1) | (slice << 4) | (up << 6))};
        for (int t = 0; t < 2; ++t) {
          input += product.bytes[t].substr(e * product.expert_bytes(t), product.expert_bytes(t));
        }
        const std::string stem = dir + "/" + product.name.substr(product.name.rfind('.') + 1) + "_slice" +
                                 std::to_string(slice) + (p == 0 ? (up ? "_up" : "_gate") : "");
        std::ofstream(stem, std::ios::binary) << input;
        // The edge scales on the first block, whose first byte then holds two codes 7 (6.0): values
        // past float32 under each.
        for (const int scale : {253, 254, 255}) {
          std::string edge = input;
          edge[1] = static_cast<char>(scale);
          edge[1 + product.expert_bytes(0)] = static_cast<char>(0x77);
          std::ofstream(stem + "_scale" + std::to_string(scale), std::ios::binary) << edge;
        }
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Products();
  WriteSeedsIfAsked(WriteSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::vector<Product>& products = Products();
  const Product& p = products[data[0] & 1];
  const int64_t e = ((data[0] >> 1) & 7) % p.experts;
  const int slice = ((data[0] >> 4) & 3) % 3;
  const bool up = (data[0] & 0x40) != 0;
  static const fs::path scratch = MakeScratchDir();
  WriteSafetensors(scratch, ProductFile(p, e, data + 1, size - 1));
  absl::StatusOr<std::unique_ptr<shardserve::Checkpoint>> ckpt = shardserve::Checkpoint::Open(scratch);
  Check(ckpt.ok(), "the fixture's own header refused");

  // The expert's blocks and scales, read as the loader reads them.
  const int64_t outs = p.out, groups = p.groups, ins = groups * kMxfp4BlockSize;
  std::vector<uint8_t> blocks(static_cast<size_t>(outs * groups * kMxfp4BlockBytes)),
      scales(static_cast<size_t>(outs * groups));
  const shardserve::Slice expert{0, e, e + 1};
  Check(ckpt.value()
            ->Read(p.name + "_blocks", {p.experts, outs, groups, kMxfp4BlockBytes}, expert, shardserve::DType::kI8,
                   blocks.data())
            .ok(),
        "the expert's blocks do not read back");
  Check(ckpt.value()
            ->Read(p.name + "_scales", {p.experts, outs, groups}, expert, shardserve::DType::kI8, scales.data())
            .ok(),
        "the expert's scales do not read back");
  const auto finite_block = [&](int64_t row, int64_t g) {
    return shardserve::Mxfp4BlockFinite(blocks.data() + (row * groups + g) * kMxfp4BlockBytes, scales[row * groups + g]);
  };

  // The dequantized path: the whole expert, as the loader dequantizes it.
  std::vector<float> dense(static_cast<size_t>(outs * ins));
  const absl::Status status =
      shardserve::DequantizeMxfp4(blocks.data(), scales.data(), outs, ins, dense.data(), p.name + "_blocks");
  if (status.ok()) {
    Check(AllFinite(dense), "a dequantized weight that is not finite");
  } else {
    Check(status.message().find(p.name + "_blocks") != std::string::npos, "a refusal that does not name the tensor");
    bool any_past = false;
    for (int64_t r = 0; r < outs; ++r) {
      for (int64_t g = 0; g < groups; ++g) any_past = any_past || !finite_block(r, g);
    }
    Check(any_past, "a refusal of an expert whose every block is finite");
  }

  // One rank's rows and blocks: gate_up_proj's gate or up rows (interleaved), halved by rows;
  // down_proj's inputs halved by blocks.
  const bool by_rows = p.name.find("gate_up") != std::string::npos;
  const int64_t period = by_rows ? 2 : 1, from = by_rows && up ? 1 : 0;
  const int64_t picked_rows = outs / period;
  int64_t row_begin = 0, row_end = picked_rows, group0 = 0, num_groups = groups;
  if (slice != 0) {
    if (by_rows) {
      row_begin = slice == 1 ? 0 : picked_rows / 2;
      row_end = slice == 1 ? picked_rows / 2 : picked_rows;
    } else {
      group0 = slice == 1 ? 0 : groups / 2;
      num_groups = slice == 1 ? groups / 2 : groups - groups / 2;
    }
  }
  std::vector<int64_t> rows;
  for (int64_t r = row_begin; r < row_end; ++r) rows.push_back(r * period + from);
  const int64_t m = static_cast<int64_t>(rows.size()), k = num_groups * kMxfp4BlockSize;
  bool all_finite = true;
  for (const int64_t r : rows) {
    for (int64_t g = group0; g < group0 + num_groups; ++g) all_finite = all_finite && finite_block(r, g);
  }

  std::vector<uint8_t> stored;
  const bool kept = shardserve::Mxfp4Rows(blocks.data(), scales.data(), groups, rows, group0, num_groups, &stored);
  Check(kept == all_finite, "Mxfp4Rows takes a slice with a value past float32, or refuses a finite one");
  if (!kept) return 0;
  Check(static_cast<int64_t>(stored.size()) == shardserve::Mxfp4RowsLayout{m, k}.bytes(), "mxfp4 rows of another size");
  Check(shardserve::Mxfp4ValuesFinite(stored.data(), m, k), "kept mxfp4 rows the kernels would refuse");
  // The reference: DequantizeMxfp4 of each picked row's blocks alone.
  std::vector<float> expected(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m; ++i) {
    const int64_t first = rows[i] * groups + group0;
    Check(shardserve::DequantizeMxfp4(blocks.data() + first * kMxfp4BlockBytes, scales.data() + first, 1, k,
                                      expected.data() + i * k, p.name)
              .ok(),
          "DequantizeMxfp4 refuses a row whose every block is finite");
  }
  std::vector<float> back(static_cast<size_t>(m * k));
  shardserve::DequantizeMxfp4Rows(back.data(), stored.data(), m, k);
  Check(SameBits(back, expected), "the mxfp4 layout dequantizes to other weights than DequantizeMxfp4");

  Check(shardserve::Mxfp4AsFp8Groups(blocks.data(), scales.data(), groups, rows, group0, num_groups, &stored),
        "Mxfp4AsFp8Groups refuses a slice Mxfp4Rows took");
  const shardserve::Fp8RowsLayout fp8{m, k, kMxfp4BlockSize};
  Check(static_cast<int64_t>(stored.size()) == fp8.bytes(), "fp8 rows of another size");
  shardserve::DequantizeFp8Groups(back.data(), reinterpret_cast<const float*>(stored.data()),
                                  stored.data() + fp8.scale_bytes(), m, k, kMxfp4BlockSize);
  Check(SameBits(back, expected), "the fp8 layout dequantizes to other weights than DequantizeMxfp4");
  return 0;
}
