// A per-process scratch directory for the files a fuzz target writes (a checkpoint, a key file),
// removed with what it holds when the process exits normally. Header-only.
#ifndef SHARDSERVE_FUZZ_SCRATCH_DIR_H_
#define SHARDSERVE_FUZZ_SCRATCH_DIR_H_

#include <errno.h>   // program_invocation_short_name (glibc)
#include <stdlib.h>  // mkdtemp

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "fuzz/check.h"

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

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_SCRATCH_DIR_H_
