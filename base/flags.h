// The one command-line flag parser of every binary (the services' mains, the `shardserve` CLI's
// subcommands, the bench tools): `--name value`, `--name=value` and `--switch`. Unknown flags,
// missing values and values out of range are errors that name the flag.
//
// Why not absl/flags (already a dependency of gRPC): its flags are process-wide globals, so every
// subcommand of `shardserve` would accept every other subcommand's flags, and --help would list
// them all; each binary and subcommand here declares its own small set at its call site instead.
//
//   absl::StatusOr<Flags> f = Flags::Parse(args, /*with_value=*/{"nodes", "model"}, /*switches=*/{"help"});
//   int nodes = 1;                                   // the default
//   SHARDSERVE_RETURN_IF_ERROR(f->Int("nodes", 1, 4096, &nodes));  // kept when absent
#ifndef SHARDSERVE_BASE_FLAGS_H_
#define SHARDSERVE_BASE_FLAGS_H_

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve {

class Flags {
 public:
  // `with_value`: flags that take a value; `switches`: flags that do not. Arguments that do not
  // start with "--" are positional.
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args, const std::set<std::string>& with_value,
                                     const std::set<std::string>& switches = {}) {
    Flags f;
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a.rfind("--", 0) != 0) {
        f.positional_.push_back(a);
        continue;
      }
      std::string name = a.substr(2), value;
      bool has_value = false;
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_value = true;
      }
      if (switches.count(name)) {
        if (has_value) return absl::InvalidArgumentError(absl::StrCat("flag --", name, " takes no value"));
        f.values_[name] = "true";
      } else if (with_value.count(name)) {
        if (!has_value) {
          if (i + 1 >= args.size()) return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
          value = args[++i];
        }
        f.values_[name] = value;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
      }
    }
    return f;
  }
  // argv[1..argc) of a service's main(), which takes no positional arguments.
  static absl::StatusOr<Flags> Parse(int argc, char** argv, const std::set<std::string>& with_value,
                                     const std::set<std::string>& switches = {}) {
    absl::StatusOr<Flags> f = Parse(std::vector<std::string>(argv + (argc > 0 ? 1 : 0), argv + (argc > 0 ? argc : 0)),
                                    with_value, switches);
    if (f.ok() && !f->positional().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", f->positional().front(), "'"));
    }
    return f;
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback) const {
    if (!Has(name)) return fallback;
    int64_t v;
    if (!absl::SimpleAtoi(Get(name), &v))
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, ": '", Get(name), "' is not an integer"));
    return v;
  }
  absl::StatusOr<double> GetDouble(const std::string& name, double fallback) const {
    if (!Has(name)) return fallback;
    double v;
    if (!absl::SimpleAtod(Get(name), &v))
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, ": '", Get(name), "' is not a number"));
    return v;
  }

  // ---- Typed and checked: `*out` keeps its value (the default) when the flag is absent ----
  // An integer in [lo, hi].
  template <typename T>
  absl::Status Int(const std::string& name, int64_t lo, int64_t hi, T* out) const {
    if (!Has(name)) return absl::OkStatus();
    int64_t v;
    if (!absl::SimpleAtoi(Get(name), &v) || v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", name, " must be an integer in [", lo, ", ", hi, "], got '", Get(name), "'"));
    }
    *out = static_cast<T>(v);
    return absl::OkStatus();
  }
  // A finite number in [lo, hi].
  absl::Status Double(const std::string& name, double lo, double hi, double* out) const {
    if (!Has(name)) return absl::OkStatus();
    double v;
    if (!absl::SimpleAtod(Get(name), &v) || !(std::isfinite(v) && v >= lo && v <= hi)) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --", name, " must be a number in [", lo, ", ", hi, "], got '", Get(name), "'"));
    }
    *out = v;
    return absl::OkStatus();
  }
  // A positive finite number.
  absl::Status Positive(const std::string& name, double* out) const {
    if (!Has(name)) return absl::OkStatus();
    double v;
    if (!absl::SimpleAtod(Get(name), &v) || !(std::isfinite(v) && v > 0)) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " must be a positive number, got ", Get(name)));
    }
    *out = v;
    return absl::OkStatus();
  }
  // One of `choices`.
  absl::Status OneOf(const std::string& name, std::initializer_list<const char*> choices, std::string* out) const {
    if (!Has(name)) return absl::OkStatus();
    for (const char* c : choices) {
      if (Get(name) == c) {
        *out = c;
        return absl::OkStatus();
      }
    }
    std::vector<std::string> names(choices.begin(), choices.end());
    const std::string last = names.back();
    names.pop_back();
    return absl::InvalidArgumentError(absl::StrCat("flag --", name, " must be ", absl::StrJoin(names, ", "),
                                                   names.empty() ? "" : " or ", last, ", got '", Get(name), "'"));
  }

  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_BASE_FLAGS_H_
