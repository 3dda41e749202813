// Minimal `--name value` / `--name=value` / `--switch` parsing for subcommands. Unknown flags and
// missing values are errors that name the flag.
#ifndef SHARDSERVE_TOOLS_CLI_FLAGS_H_
#define SHARDSERVE_TOOLS_CLI_FLAGS_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardserve::cli {

class Flags {
 public:
  // `with_value`: flags that take a value; `switches`: flags that do not.
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
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

}  // namespace shardserve::cli

#endif  // SHARDSERVE_TOOLS_CLI_FLAGS_H_
