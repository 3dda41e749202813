// The coordinator's generation_config.json reader (coordinator/model/served_model.h): the input is
// the file's text, parsed by ParseGenerationEos as ServedModel::Open parses it.
//
// Invariants: a refusal is InvalidArgument naming the file; accepted ids are token ids in
// [0, 2^31), appended after those already there; a refused file may have appended some, which
// Open then discards with the model.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "coordinator/model/served_model.h"
#include "fuzz/check.h"

using shardserve_fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<int32_t> ids = {7};  // config.json's, already there
  const absl::Status s = shardserve::ParseGenerationEos(text, "generation_config.json", &ids);
  Check(!ids.empty() && ids[0] == 7, "the ids already there changed");
  if (!s.ok()) {
    Check(absl::IsInvalidArgument(s), "a refusal that is not InvalidArgument");
    Check(s.message().find("generation_config.json") != std::string_view::npos, "a refusal that does not name the file");
    return 0;
  }
  for (int32_t id : ids) Check(id >= 0, "a negative token id");
  return 0;
}
