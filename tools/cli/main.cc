// shardserve: one binary, many subcommands (see `shardserve --help`).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "base/version.h"
#include "tools/cli/command.h"

namespace shardserve::cli {
std::vector<Command>& Commands() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace shardserve::cli

int main(int argc, char** argv) {
  using shardserve::cli::Commands;
  auto& commands = Commands();
  std::sort(commands.begin(), commands.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  std::string sub = argc > 1 ? argv[1] : "--help";
  if (sub == "--help" || sub == "-h" || sub == "help") {
    std::printf("usage: shardserve <command> [flags]   (shardserve <command> --help for its flags)\n"
                "       shardserve --version\n\ncommands:\n");
    for (const auto& c : commands) std::printf("  %-14s %s\n", c.name.c_str(), c.summary.c_str());
    return argc > 1 ? 0 : 2;
  }
  if (sub == "--version" || sub == "version") {
    std::printf("shardserve %s\n", shardserve::kVersion);
    return 0;
  }
  for (const auto& c : commands) {
    if (c.name == sub) return c.run(std::vector<std::string>(argv + 2, argv + argc));
  }
  std::fprintf(stderr, "shardserve: unknown command '%s' (see shardserve --help)\n", sub.c_str());
  return 2;
}
