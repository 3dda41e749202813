// What the fuzz targets that write each input as a checkpoint share: a per-process scratch
// directory, a fixture tensor's bytes, and a safetensors file of given tensors and data.
// Header-only.
#ifndef SHARDSERVE_FUZZ_SCRATCH_CHECKPOINT_H_
#define SHARDSERVE_FUZZ_SCRATCH_CHECKPOINT_H_

#include <errno.h>  // program_invocation_short_name (glibc)
#include <stdlib.h>  // mkdtemp

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fuzz/check.h"
#include "model/checkpoint.h"
#include "nlohmann/json.hpp"

namespace shardserve_fuzz {

// A new directory under the system's temporary one, named after the target (mkdtemp), removed
// with what it holds when the process exits normally (a crash leaves it, beside its input).
inline std::filesystem::path MakeScratchDir() {
  static std::vector<std::filesystem::path>* made = [] {
    std::atexit([] {
      std::error_code ec;
      for (const std::filesystem::path& dir : *made) std::filesystem::remove_all(dir, ec);
    });
    return new std::vector<std::filesystem::path>();
  }();
  std::string tmpl =
      (std::filesystem::temp_directory_path() / (std::string(program_invocation_short_name) + ".XXXXXX")).string();
  Check(mkdtemp(tmpl.data()) != nullptr, "cannot make a scratch directory");
  made->push_back(tmpl);
  return tmpl;
}

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

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_SCRATCH_CHECKPOINT_H_
