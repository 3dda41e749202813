// The `shardserve` tool's subcommands. Each cmd_*.cc file defines one and registers it with a
// static CommandRegistration, so adding a subcommand touches no other file.
#ifndef SHARDSERVE_TOOLS_CLI_COMMAND_H_
#define SHARDSERVE_TOOLS_CLI_COMMAND_H_

#include <string>
#include <vector>

namespace shardserve::cli {

struct Command {
  std::string name;     // "generate-ids"
  std::string summary;  // one line for `shardserve --help`
  // Runs with the arguments after the subcommand name; returns the process exit code.
  int (*run)(const std::vector<std::string>& args);
};

std::vector<Command>& Commands();

struct CommandRegistration {
  explicit CommandRegistration(Command c) { Commands().push_back(std::move(c)); }
};

}  // namespace shardserve::cli

#endif  // SHARDSERVE_TOOLS_CLI_COMMAND_H_
