// model.safetensors.index.json (model/checkpoint.h): the input is the index's text, parsed by
// ParseSafetensorsIndex and then opened as Checkpoint::Open opens a sharded checkpoint, in a
// scratch directory beside the three shards of tests/fixtures/models/mistral_sharded (linked once).
//
// Invariants: a refused index is DataLoss, and Open refuses it too; an accepted weight_map names
// only plain file names inside the directory (not empty, ".", "..", no '/' or NUL); when Open
// succeeds, every tensor the index lists is in the checkpoint, in the file the index names, and
// (for a non-empty index) the checkpoint holds no tensor the index does not list.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "fuzz/check.h"
#include "fuzz/scratch_dir.h"
#include "model/checkpoint.h"

namespace {

using shardserve_fuzz::Check;

namespace fs = std::filesystem;

// The scratch checkpoint directory: the fixture's shards linked in, the index written per input.
const fs::path& ScratchDir() {
  static const fs::path* dir = [] {
    auto* scratch = new fs::path(shardserve_fuzz::MakeScratchDir());
    const fs::path fixture = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/mistral_sharded";
    for (const fs::directory_entry& e : fs::directory_iterator(fixture)) {
      if (e.path().extension() == ".safetensors") fs::create_symlink(e.path(), *scratch / e.path().filename());
    }
    return scratch;
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ScratchDir();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string> weight_map;
  const absl::Status parsed = shardserve::ParseSafetensorsIndex(text, "model.safetensors.index.json", &weight_map);
  Check(parsed.ok() || absl::IsDataLoss(parsed), "a refusal that is not DataLoss");
  for (const auto& [tensor, file] : weight_map) {
    Check(!file.empty() && file != "." && file != ".." && file.find('/') == std::string::npos &&
              file.find('\0') == std::string::npos,
          "a weight_map file that is not a plain name inside the directory");
  }
  {
    std::ofstream out(ScratchDir() / "model.safetensors.index.json", std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    Check(out.good(), "cannot write the scratch index");
  }
  absl::StatusOr<std::unique_ptr<shardserve::Checkpoint>> ckpt = shardserve::Checkpoint::Open(ScratchDir());
  if (!parsed.ok()) {
    Check(!ckpt.ok(), "Open takes an index the parser refuses");
    return 0;
  }
  if (!ckpt.ok()) return 0;  // a file it names is missing or not a safetensors file, or the tensors differ
  for (const auto& [tensor, file] : weight_map) {
    auto it = (*ckpt)->tensors().find(tensor);
    Check(it != (*ckpt)->tensors().end(), "a tensor the index lists is missing");
    Check(it->second.file == file, "a tensor in another file than the index names");
  }
  Check(weight_map.empty() || (*ckpt)->tensors().size() == weight_map.size(), "a tensor the index does not list");
  return 0;
}
