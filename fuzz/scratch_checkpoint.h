// What the fuzz targets that write each input as a checkpoint share: a fixture tensor's bytes, a
// safetensors file of given tensors and data written to a scratch directory (fuzz/scratch_dir.h),
// and the check that the weights read back are finite. Header-only.
#ifndef SHARDSERVE_FUZZ_SCRATCH_CHECKPOINT_H_
#define SHARDSERVE_FUZZ_SCRATCH_CHECKPOINT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz/check.h"
#include "fuzz/scratch_dir.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"

namespace shardserve_fuzz {

// `n` bytes of `file` from `offset` (a fixture tensor's data: TensorInfo's file, offset, nbytes).
inline std::string ReadFileBytes(const std::filesystem::path& file, uint64_t offset, uint64_t n) {
  std::ifstream in(file, std::ios::binary);
  std::string out(n, '\0');
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(out.data(), static_cast<std::streamsize>(n));
  Check(in.good() || n == 0, "cannot read a fixture");
  return out;
}

// A safetensors file holding `tensors` (their names, dtypes and shapes) in order, their data one
// after the other in `data` (each tensor's nbytes).
inline std::string SafetensorsFile(const std::vector<shardserve::TensorInfo>& tensors, const std::string& data) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t offset = 0;
  for (const shardserve::TensorInfo& t : tensors) {
    header[t.name] = {{"dtype", t.dtype_name()}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  Check(offset == data.size(), "tensor data of another size than the tensors'");
  const std::string json = header.dump();
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return file + json + data;
}

// Writes `file` as `dir`/model.safetensors, replacing what was there.
inline void WriteSafetensors(const std::filesystem::path& dir, const std::string& file) {
  std::ofstream out(dir / "model.safetensors", std::ios::binary | std::ios::trunc);
  out << file;
  Check(out.good(), "cannot write the scratch checkpoint");
}

// Whether every weight is finite.
inline bool AllFinite(const std::vector<float>& w) {
  return std::all_of(w.begin(), w.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_SCRATCH_CHECKPOINT_H_
