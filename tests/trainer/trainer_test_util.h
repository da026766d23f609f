// Shared helpers of the trainer tests: running the trainer in-process or as a program, temp
// folders, reading metrics.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../scratch_dir.h"
#include "app.h"

namespace fusebox::trainer::testing {

/// Result of one trainer invocation.
struct Result {
  int code = -1;
  std::string out, err;
};

/// Runs trainer_main in this process.
inline Result run_trainer(std::vector<std::string> args) {
  std::ostringstream out, err;
  Result r;
  r.code = trainer_main(args, out, err, false);
  r.out = out.str(), r.err = err.str();
  return r;
}

/// A fresh folder removed at the end of the test.
class TempDir : public ::fusebox::testing::ScratchDir {
 public:
  TempDir() : ScratchDir("trainer-test") {}
  /// Writes `text` to `name` and returns the path.
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(file(name)) << text;
    return file(name);
  }
};

/// A run of sgd on a tensors file of 10 samples with 2 held out, in batches of 4 (an epoch every
/// 2 steps), for 7 steps, with `every_n_epochs` (an option counted in epochs) set to 1.
inline std::vector<std::string> two_step_epochs_run(const std::string& data,
                                                    const std::string& every_n_epochs) {
  return {
      "--optimizer",    "sgd", "--model-width",      "2", "--dataset",         "tensors:" + data,
      "--eval-holdout", "0.2", "--train-batch-size", "4", "--max-train-steps", "7",
      every_n_epochs,   "1",   "--log-every",        "0"};
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// The "loss" of every line of a metrics.jsonl file.
inline std::vector<double> losses(const std::string& jsonl_path) {
  std::vector<double> out;
  std::ifstream in(jsonl_path);
  std::string line;
  while (std::getline(in, line)) {
    size_t p = line.find("\"loss\":");
    if (p != std::string::npos) out.push_back(std::stod(line.substr(p + 7)));
  }
  return out;
}

/// Mean of `v[from, to)`.
inline double mean(const std::vector<double>& v, size_t from, size_t to) {
  double s = 0;
  for (size_t i = from; i < to; ++i) s += v[i];
  return s / static_cast<double>(to - from);
}

/// The repository root (two levels above tests/data).
inline std::string repo_root() {
  return std::filesystem::path(FUSEBOX_TEST_DATA).parent_path().parent_path().string();
}

/// Options that load plugins from the build tree only.
inline std::vector<std::string> plugin_args(const std::string& plugin) {
  return {"--plugin-dir",          FUSEBOX_PLUGIN_DIR,   "--plugin-dir",
          FUSEBOX_TEST_PLUGIN_DIR, "--optimizer-plugin", plugin};
}

/// Concatenates argument lists.
inline std::vector<std::string> join(std::vector<std::string> a,
                                     const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Number of lines in `s`.
inline int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

/// Runs the real trainer program with a shell command line; captures stdout and stderr.
inline Result run_program(const std::string& args, const std::string& dir) {
  const std::string out = dir + "/stdout.txt", err = dir + "/stderr.txt";
  const std::string cmd = "timeout -k 5 600 " + std::string(FUSEBOX_BIN_DIR) + "/trainer " + args +
                          " >" + out + " 2>" +
                          err;  // a hung run fails the test instead of the whole suite
  int status = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out), r.err = read_text(err);
  return r;
}

}  // namespace fusebox::trainer::testing
