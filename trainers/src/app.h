// The trainer program as a function, so tests can run it in-process.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace fusebox::trainer {

/// Exit statuses.
enum ExitCode : int {
  kExitOk = 0,
  kExitInternal = 1,  ///< an unexpected exception (a bug)
  kExitUsage = 2,     ///< configuration, command-line, plugin or file error; nothing trained
  kExitTraining = 3,  ///< training started and failed (plugin exception, non-finite gradients)
};

/// Runs the trainer with `args` (argv without the program name). Errors are printed as one line
/// "trainer: error: <message>" on `err`.
int trainer_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                 bool terminal);

}  // namespace fusebox::trainer
