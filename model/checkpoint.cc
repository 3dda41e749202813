#include "model/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status_macros.h"
#include "kernels/quant.h"
#include "nlohmann/json.hpp"

namespace shardserve {

const char* TensorInfo::dtype_name() const {
  switch (extra) {
    case Extra::kF8E4M3: return "F8_E4M3";
    case Extra::kI64: return "I64";
    case Extra::kU8: return "U8";
    case Extra::kBool: return "BOOL";
    case Extra::kNone: break;
  }
  return DTypeName(dtype);
}

namespace {

using json = nlohmann::json;

// A header larger than this is not a safetensors header we believe (the format caps it at 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string ShapeString(const std::vector<int64_t>& s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

// The stored dtype of a header entry into info->dtype / info->extra (TensorInfo).
absl::Status ParseDType(const std::string& s, TensorInfo* info) {
  if (s == "F32") {
    info->dtype = DType::kF32;
  } else if (s == "F16") {
    info->dtype = DType::kF16;
  } else if (s == "BF16") {
    info->dtype = DType::kBF16;
  } else if (s == "I32") {
    info->dtype = DType::kI32;
  } else if (s == "F8_E4M3") {
    info->dtype = DType::kI8;
    info->extra = TensorInfo::Extra::kF8E4M3;
  } else if (s == "I64") {
    info->dtype = DType::kI32;
    info->extra = TensorInfo::Extra::kI64;
  } else if (s == "U8" || s == "BOOL") {
    info->dtype = DType::kI8;
    info->extra = s == "U8" ? TensorInfo::Extra::kU8 : TensorInfo::Extra::kBool;
  } else {
    return absl::UnimplementedError(
        absl::StrCat("dtype ", s, " is not supported (supported: F32, F16, BF16, I32, I64, F8_E4M3, U8, BOOL)"));
  }
  return absl::OkStatus();
}

// a * b into *out, false on int64 overflow or negative operands.
bool MulChecked(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0) return false;
  return !__builtin_mul_overflow(a, b, out);
}

// One tensor's data_offsets, relative to the data section.
struct Range {
  uint64_t begin = 0, end = 0;
  std::string name;
};

std::string RangeString(const Range& r) { return absl::StrCat("\"", r.name, "\" [", r.begin, ", ", r.end, "]"); }

// The safetensors format requires the tensors' data_offsets to tile the data section exactly:
// sorted by begin, the first begins at 0, each begins where the previous ends, and the last ends
// at the end of the file. An overlap would let one tensor read another's bytes (a corrupt or
// hostile header giving different tokens without an error); a hole is bytes nobody accounts for.
absl::Status CheckRangesTile(std::vector<Range> ranges, uint64_t data_size, const std::string& file) {
  // Zero-byte tensors sort before a tensor with the same begin, so they never look like overlaps.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name); });
  constexpr char kRule[] = "; the tensors' data_offsets must tile the data section exactly (corrupt or lying header)";
  uint64_t covered = 0;  // the data section's bytes [0, covered) belong to the ranges seen so far
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    if (r.begin < covered) {
      return absl::DataLossError(absl::StrCat(file, ": tensor ", RangeString(r), " overlaps tensor ",
                                              RangeString(ranges[i - 1]), kRule));
    }
    if (r.begin > covered) {
      return absl::DataLossError(absl::StrCat(
          file, ": data bytes [", covered, ", ", r.begin, ") belong to no tensor (a hole ",
          i == 0 ? "before the first " : absl::StrCat("between tensor ", RangeString(ranges[i - 1]), " and "),
          "tensor ", RangeString(r), ")", kRule));
    }
    covered = r.end;
  }
  if (covered != data_size) {
    return absl::DataLossError(absl::StrCat(file, ": data bytes [", covered, ", ", data_size,
                                            ") after the last tensor",
                                            ranges.empty() ? "" : absl::StrCat(" ", RangeString(ranges.back())),
                                            " belong to no tensor", kRule));
  }
  return absl::OkStatus();
}

// The index of the first NaN or infinity among n values of a float type (exponent bits all ones),
// or -1.
int64_t FirstNonFinite(const uint8_t* p, DType type, size_t n) {
  const auto first = [n](auto load, auto mask) -> int64_t {
    for (size_t i = 0; i < n; ++i) {
      if ((load(i) & mask) == mask) return static_cast<int64_t>(i);
    }
    return -1;
  };
  switch (type) {
    case DType::kF32:
      return first([p](size_t i) { uint32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }, uint32_t{0x7f800000});
    case DType::kBF16:
      return first([p](size_t i) { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }, uint16_t{0x7f80});
    case DType::kF16:
      return first([p](size_t i) { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return v; }, uint16_t{0x7c00});
    default:
      return -1;
  }
}

// One value of a float type at p[i] (kI8: a float8 e4m3fn code), as float32 (exact).
template <DType kType>
float LoadFloat(const uint8_t* p, size_t i) {
  if constexpr (kType == DType::kF32) {
    float v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  } else if constexpr (kType == DType::kI8) {
    return Fp8E4m3ToFloat(p[i]);
  } else {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return kType == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
  }
}

// Stores v into p[i] as kType (rounded to nearest even, as ConvertOnHost does); returns 1 when the
// stored value is NaN or infinite (exponent bits all ones), else 0.
template <DType kType>
uint32_t StoreFloat(uint8_t* p, size_t i, float v) {
  if constexpr (kType == DType::kF32) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    std::memcpy(p + 4 * i, &u, 4);
    return (u & 0x7f800000u) == 0x7f800000u;
  } else {
    const uint16_t h = kType == DType::kBF16 ? F32ToBf16(v) : F32ToF16(v);
    std::memcpy(p + 2 * i, &h, 2);
    const uint16_t mask = kType == DType::kBF16 ? 0x7f80 : 0x7c00;
    return (h & mask) == mask;
  }
}

// The index of the first NaN among n float8 e4m3fn codes (S.1111.111; the format has no infinity), or -1.
int64_t FirstNanFp8E4m3(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if ((p[i] & 0x7f) == 0x7f) return static_cast<int64_t>(i);
  }
  return -1;
}

// Converts n values (kSrc as LoadFloat reads it) to kDst at `to` and returns the index of the first
// stored value that is NaN or infinite, or -1. kSrc == kDst == kI8 copies float8 e4m3fn codes raw
// (their NaN: S.1111.111; the format has no infinity). The test rides on the conversion's own loop
// (one OR per value), so the weight's bytes are read once; only a checkpoint that fails looks
// again, for where.
template <DType kSrc, DType kDst>
int64_t ConvertFinite(uint8_t* to, const uint8_t* from, size_t n) {
  uint64_t found = 0;
  if constexpr (kSrc == kDst) {
    // A copy of the bits as they are, 8 bytes at a time, each word tested lane-wise in one register
    // for a value whose exponent bits are all ones: with z = (word & exponents) ^ exponents (every
    // lane's top bit clear), a lane is non-finite exactly when z's lane is zero, and
    // (z - lane_ones) & ~z & lane_tops is nonzero exactly when z has a zero lane (a borrow crosses
    // into the next lane only from a zero lane, which counts anyway).
    constexpr size_t kSize = kDst == DType::kF32 ? 4 : kDst == DType::kI8 ? 1 : 2;
    constexpr uint64_t kMask = kDst == DType::kF32    ? 0x7f800000u
                               : kDst == DType::kBF16 ? 0x7f80u
                               : kDst == DType::kF16  ? 0x7c00u
                                                      : 0x7fu;  // one lane's exponent bits
    constexpr uint64_t kLaneOnes = kSize == 4 ? 0x0000000100000001ull
                                   : kSize == 2 ? 0x0001000100010001ull
                                                : 0x0101010101010101ull;
    constexpr uint64_t kExponents = kMask * kLaneOnes, kLaneTops = kLaneOnes << (8 * kSize - 1);
    const size_t words = n * kSize / 8;
    for (size_t w = 0; w < words; ++w) {
      uint64_t x;
      std::memcpy(&x, from + 8 * w, 8);
      std::memcpy(to + 8 * w, &x, 8);
      const uint64_t z = (x & kExponents) ^ kExponents;
      found |= (z - kLaneOnes) & ~z & kLaneTops;
    }
    for (size_t i = words * 8 / kSize; i < n; ++i) {  // the values after the last whole word
      uint64_t v = 0;
      std::memcpy(&v, from + kSize * i, kSize);
      std::memcpy(to + kSize * i, &v, kSize);
      found |= (v & kMask) == kMask;
    }
  } else {
    for (size_t i = 0; i < n; ++i) found |= StoreFloat<kDst>(to, i, LoadFloat<kSrc>(from, i));
  }
  if (found == 0) return -1;
  return kDst == DType::kI8 ? FirstNanFp8E4m3(to, n) : FirstNonFinite(to, kDst, n);
}

template <DType kSrc>
int64_t ConvertFiniteTo(uint8_t* to, DType dst_type, const uint8_t* from, size_t n) {
  switch (dst_type) {
    case DType::kF32: return ConvertFinite<kSrc, DType::kF32>(to, from, n);
    case DType::kF16: return ConvertFinite<kSrc, DType::kF16>(to, from, n);
    case DType::kBF16: return ConvertFinite<kSrc, DType::kBF16>(to, from, n);
    case DType::kI8:
      if constexpr (kSrc == DType::kI8) return ConvertFinite<DType::kI8, DType::kI8>(to, from, n);
      return -1;
    default: return -1;  // Read refuses other types before
  }
}

// ConvertFinite for types known at run time: src_type F32, F16, BF16, or kI8 for float8 e4m3fn
// codes (read as a float type, or raw as kI8).
int64_t ConvertFinite(uint8_t* to, DType dst_type, const uint8_t* from, DType src_type, size_t n) {
  switch (src_type) {
    case DType::kF32: return ConvertFiniteTo<DType::kF32>(to, dst_type, from, n);
    case DType::kF16: return ConvertFiniteTo<DType::kF16>(to, dst_type, from, n);
    case DType::kBF16: return ConvertFiniteTo<DType::kBF16>(to, dst_type, from, n);
    case DType::kI8: return ConvertFiniteTo<DType::kI8>(to, dst_type, from, n);
    default: return -1;
  }
}

}  // namespace

absl::Status ParseSafetensorsHeader(const uint8_t* data, uint64_t file_size, const std::string& file,
                                    std::vector<TensorInfo>* out) {
  if (file_size < 8) {
    return absl::DataLossError(absl::StrCat(file, ": ", file_size, " bytes is too short for a safetensors file (truncated?)"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];  // little-endian u64
  if (header_len > kMaxHeaderBytes || header_len > file_size - 8) {
    return absl::DataLossError(absl::StrCat(file, ": header length ", header_len, " exceeds the file (", file_size,
                                            " bytes); the file is truncated or not safetensors"));
  }
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;
  std::vector<Range> ranges;  // every tensor's data_offsets, for CheckRangesTile
  absl::StatusOr<json> parsed =
      ParseJson<json>(std::string_view(reinterpret_cast<const char*>(data) + 8, header_len), absl::StrCat(file, ": header"));
  if (!parsed.ok()) return absl::DataLossError(parsed.status().message());
  const json header = *std::move(parsed);
  if (!header.is_object()) return absl::DataLossError(absl::StrCat(file, ": header is not a JSON object"));
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const json& t = it.value();
    auto bad = [&](const std::string& why) {
      return absl::DataLossError(absl::StrCat(file, ": tensor \"", name, "\": ", why));
    };
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets")) {
      return bad("entry needs dtype, shape and data_offsets");
    }
    if (!t["dtype"].is_string()) return bad("dtype is not a string");
    TensorInfo info;
    if (absl::Status dtype = ParseDType(t["dtype"].get<std::string>(), &info); !dtype.ok()) {
      return absl::UnimplementedError(absl::StrCat(file, ": tensor \"", name, "\": ", dtype.message()));
    }
    info.name = name;
    info.file = file;
    if (!t["shape"].is_array() || t["shape"].size() > 4) return bad("shape is not a list of at most 4 dimensions");
    int64_t numel = 1;
    for (const json& d : t["shape"]) {
      if (!d.is_number_unsigned()) return bad(absl::StrCat("shape ", t["shape"].dump(), " has a non-integer or negative dimension"));
      uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(INT64_MAX) || !MulChecked(numel, static_cast<int64_t>(dim), &numel)) {
        return bad(absl::StrCat("shape ", t["shape"].dump(), " overflows"));
      }
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    int64_t nbytes = 0;
    if (!MulChecked(numel, static_cast<int64_t>(info.element_size()), &nbytes)) {
      return bad(absl::StrCat("shape ", t["shape"].dump(), " overflows"));
    }
    const json& off = t["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return bad("data_offsets must be two non-negative integers");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end, "] lie outside the ", data_size,
                              " data bytes of the file (truncated or lying header)"));
    }
    if (end - begin != static_cast<uint64_t>(nbytes)) {
      return bad(absl::StrCat("data_offsets span ", end - begin, " bytes but dtype ", info.dtype_name(), " x shape ",
                              ShapeString(info.shape), " needs ", nbytes));
    }
    info.offset = data_start + begin;
    info.nbytes = static_cast<uint64_t>(nbytes);
    ranges.push_back(Range{begin, end, name});
    out->push_back(std::move(info));
  }
  return CheckRangesTile(std::move(ranges), data_size, file);
}

// One read-only mmap of a safetensors file.
struct Checkpoint::Mapping {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
  ~Mapping() {
    if (data != nullptr && size > 0) munmap(const_cast<uint8_t*>(data), size);
  }
};

absl::Status ParseSafetensorsIndex(std::string_view text, const std::string& source,
                                   std::map<std::string, std::string>* weight_map) {
  absl::StatusOr<json> parsed = ParseJson<json>(text, source);
  if (!parsed.ok()) return absl::DataLossError(parsed.status().message());
  const json& index = *parsed;
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::DataLossError(absl::StrCat(source, ": not valid JSON with a \"weight_map\" object"));
  }
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return absl::DataLossError(absl::StrCat(source, ": weight_map entry \"", it.key(), "\" is not a file name"));
    }
    const std::string& f = it.value().get_ref<const std::string&>();
    // A NUL would end the name open() sees early: another file than the one named.
    if (f.empty() || f.find('/') != std::string::npos || f.find('\0') != std::string::npos || f == "." || f == "..") {
      return absl::DataLossError(absl::StrCat(source, ": weight_map entry \"", it.key(), "\" names \"",
                                              absl::CEscape(f),
                                              "\", which is not a file name inside the checkpoint directory"));
    }
    (*weight_map)[it.key()] = f;
  }
  return absl::OkStatus();
}

Checkpoint::~Checkpoint() = default;

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::filesystem::path& dir) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->dir_ = dir;
  if (!std::filesystem::is_directory(dir)) {
    return absl::NotFoundError(absl::StrCat(dir.string(), ": not a checkpoint directory"));
  }

  // Which files: the index's weight_map when present, else model.safetensors.
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;  // tensor -> file, from the index
  const std::filesystem::path index_path = dir / "model.safetensors.index.json";
  if (std::filesystem::exists(index_path)) {
    std::ifstream in(index_path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    SHARDSERVE_RETURN_IF_ERROR(ParseSafetensorsIndex(ss.str(), index_path.string(), &weight_map));
    std::set<std::string> unique;
    for (const auto& [tensor, file] : weight_map) unique.insert(file);
    files.assign(unique.begin(), unique.end());
  } else if (std::filesystem::exists(dir / "model.safetensors")) {
    files.push_back("model.safetensors");
  } else {
    return absl::NotFoundError(absl::StrCat(dir.string(), ": no model.safetensors or model.safetensors.index.json"));
  }

  for (const std::string& f : files) {
    const std::string path = (dir / f).string();
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open (", std::strerror(errno), ")"));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::DataLossError(absl::StrCat(path, ": not a regular file"));
    }
    auto mapping = std::make_unique<Mapping>();
    mapping->size = static_cast<uint64_t>(st.st_size);
    if (mapping->size > 0) {
      void* p = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        return absl::InternalError(absl::StrCat(path, ": mmap failed (", std::strerror(errno), ")"));
      }
      mapping->data = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
    std::vector<TensorInfo> infos;
    SHARDSERVE_RETURN_IF_ERROR(ParseSafetensorsHeader(mapping->data, mapping->size, path, &infos));
    for (TensorInfo& info : infos) {
      info.file = f;
      auto wm = weight_map.find(info.name);
      if (!weight_map.empty() && (wm == weight_map.end() || wm->second != f)) {
        return absl::DataLossError(absl::StrCat(path, ": holds tensor \"", info.name,
                                                "\", which model.safetensors.index.json does not place in this file"));
      }
      if (ckpt->tensors_.count(info.name)) {
        return absl::DataLossError(absl::StrCat(path, ": tensor \"", info.name, "\" appears twice in the checkpoint"));
      }
      ckpt->tensors_[info.name] = std::move(info);
    }
    ckpt->files_[f] = std::move(mapping);
  }
  for (const auto& [name, file] : weight_map) {
    if (!ckpt->tensors_.count(name)) {
      return absl::DataLossError(absl::StrCat((dir / file).string(), ": tensor \"", name,
                                              "\" is listed in model.safetensors.index.json but missing from the file"));
    }
  }
  return ckpt;
}

absl::StatusOr<const TensorInfo*> Checkpoint::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_.string(), ": tensor \"", name, "\" is missing from the checkpoint"));
  }
  return &it->second;
}

absl::Status Checkpoint::CheckShape(const std::string& name, const std::vector<int64_t>& expected_shape) const {
  absl::StatusOr<const TensorInfo*> found = Find(name);
  if (!found.ok()) return found.status();
  const TensorInfo& t = **found;
  if (t.shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat((dir_ / t.file).string(), ": tensor \"", name, "\" has shape ",
                                                   ShapeString(t.shape), " but config.json implies ",
                                                   ShapeString(expected_shape)));
  }
  return absl::OkStatus();
}

absl::Status Checkpoint::Read(const std::string& name, const std::vector<int64_t>& expected_shape, const Slice& slice,
                              DType dst_type, void* dst) const {
  SHARDSERVE_RETURN_IF_ERROR(CheckShape(name, expected_shape));
  const TensorInfo& t = tensors_.at(name);
  const std::string where = (dir_ / t.file).string();
  if (t.shape.empty() || t.shape.size() > 4 || (t.shape.size() > 2 && slice.dim != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": tensor \"", name, "\" is ", t.shape.size(),
                                                   "-D; only 1-D and 2-D tensors can be read, and rows of 3-D and 4-D ones"));
  }
  // Float weights convert between F32, F16 and BF16; I32 / I64 tensors (packed values, zeros,
  // g_idx, shapes: model/quantized_checkpoint.h) are read only as I32; F8_E4M3 as a float type
  // (decoded) or as I8 (raw).
  const bool int_src = t.dtype == DType::kI32, fp8_src = t.extra == TensorInfo::Extra::kF8E4M3,
             u8_src = t.extra == TensorInfo::Extra::kU8 || t.extra == TensorInfo::Extra::kBool;
  const bool ok_type = int_src  ? dst_type == DType::kI32
                       : u8_src ? dst_type == DType::kI8
                                : dst_type != DType::kI32 && (dst_type != DType::kI8 || fp8_src);
  if (!ok_type) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": tensor \"", name, "\" has dtype ", t.dtype_name(),
                                                   dst_type == DType::kI32 ? "; expected I32"
                                                   : fp8_src || int_src || u8_src
                                                       ? absl::StrCat("; it cannot be read as ", DTypeName(dst_type))
                                                       : "; weights must be F32, F16 or BF16"));
  }
  const int64_t rows = t.shape[0];
  int64_t cols = 1;  // the product of the other dimensions (bounded by the file's size at Open)
  for (size_t d = 1; d < t.shape.size(); ++d) cols *= t.shape[d];
  if (slice.dim < 0 || slice.dim >= static_cast<int>(t.shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": slice dimension ", slice.dim, " out of range"));
  }
  const int64_t extent = t.shape[slice.dim];
  const int64_t begin = slice.begin, end = slice.end < 0 ? extent : slice.end;
  if (begin < 0 || begin > end || end > extent) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": slice [", begin, ", ", end,
                                                   ") of dimension ", slice.dim, " outside [0, ", extent, ")"));
  }
  const uint8_t* base = files_.at(t.file)->data + t.offset;
  const size_t es = t.element_size(), ds = DTypeSize(dst_type);
  uint8_t* out = static_cast<uint8_t*>(dst);
  bool narrowed = true;  // every I64 value fits in I32
  // A NaN or Inf weight makes every output NaN: refused here, naming it, not found as garbage
  // tokens or a failed step. Float values are checked as they are converted (ConvertFinite: no
  // second pass over the weight's bytes), in the destination's type (a float32 weight beyond
  // float16's range is an infinity there); fp8 codes read raw, by their NaN encoding.
  int64_t bad = -1;  // index into dst of the first non-finite value
  const auto copy = [&](uint8_t* to, const uint8_t* from, size_t n, size_t at /* dst index of to[0] */) {
    int64_t first = -1;
    if (t.extra == TensorInfo::Extra::kI64) {
      for (size_t i = 0; i < n; ++i) {
        int64_t v;
        std::memcpy(&v, from + 8 * i, 8);
        narrowed = narrowed && v >= INT32_MIN && v <= INT32_MAX;
        const auto v32 = static_cast<int32_t>(v);
        std::memcpy(to + 4 * i, &v32, 4);
      }
    } else if (dst_type == DType::kI32 || u8_src) {
      std::memcpy(to, from, n * ds);
    } else {
      first = ConvertFinite(to, dst_type, from, fp8_src ? DType::kI8 : t.dtype, n);
    }
    if (first >= 0 && bad < 0) bad = static_cast<int64_t>(at) + first;
  };
  if (slice.dim == 0) {
    // A row range is one contiguous run of bytes.
    const size_t n = static_cast<size_t>((end - begin) * cols);
    copy(out, base + static_cast<size_t>(begin * cols) * es, n, 0);
  } else {
    // A column range: one contiguous run per row.
    const size_t n = static_cast<size_t>(end - begin);
    for (int64_t r = 0; r < rows && bad < 0; ++r) {
      copy(out + static_cast<size_t>(r) * n * ds, base + static_cast<size_t>(r * cols + begin) * es, n,
           static_cast<size_t>(r) * n);
    }
  }
  if (!narrowed) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": tensor \"", name, "\" (I64) holds a value outside the int32 range"));
  }
  if (bad >= 0) {
    const int64_t width = slice.dim == 0 ? cols : end - begin;
    const int64_t row = bad / width + (slice.dim == 0 ? begin : 0), col = bad % width + (slice.dim == 0 ? 0 : begin);
    float value = std::numeric_limits<float>::quiet_NaN();  // an fp8 code read raw: its only non-finite value
    if (dst_type != DType::kI8) ConvertOnHost(&value, DType::kF32, out + static_cast<size_t>(bad) * ds, dst_type, 1);
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": tensor \"", name, "\": ", name, "[", row, "]", t.shape.size() == 2 ? absl::StrCat("[", col, "]") : "",
        " is ", value, "; weights and scales must be finite (the checkpoint is corrupt: a model with such a "
        "value computes only NaN)"));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
