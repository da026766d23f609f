// `trainer --nproc-per-node N`: starts N copies of this program as the ranks of one data-parallel
// job on this machine, with torchrun's environment, and waits for them.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace fusebox::trainer {

/// Called by main(): this process is the trainer program, so it may start copies of itself.
void allow_self_launch();

/// True when this process already is a rank of a launched job (WORLD_SIZE is set).
bool launched_as_rank();

/// "rank N: " in a rank of a launched job, else "": each rank's error lines say which it was.
std::string rank_label();

/// The line an error gets on stderr: "trainer: error: ", the rank in a job, then `message` with
/// its line breaks escaped, and a line break.
std::string error_line(const std::string& message);

/// Runs `args` as `nproc` local ranks; returns the exit code for the whole job (rank 0's if it
/// failed, else the first failure's, else 0). A rank that fails gives the others `grace_seconds`
/// to stop on their own before they are terminated.
int launch_local_ranks(const std::vector<std::string>& args, int64_t nproc, double grace_seconds,
                       std::ostream& err);

}  // namespace fusebox::trainer
