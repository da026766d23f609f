// A graceful stop on SIGINT / SIGTERM (Ctrl-C, `kill`, a scheduler's preemption): the signal is
// only noted, and the training loop finishes its step, saves a checkpoint and stops. A second
// signal, a second or more after the first, stops the process at once (the default action); one
// sooner is taken for the same request (a terminal's Ctrl-C reaches a data-parallel job's ranks
// both directly and through the launcher).
#pragma once

#include <stdexcept>
#include <string>

namespace fusebox::trainer {

/// Installs the handlers (the trainer program does; the launcher replaces them with its own).
void install_interrupt_handlers();

/// The signal asking to stop (SIGINT, SIGTERM), or 0.
int interrupt_signal();

/// "SIGINT", "SIGTERM", ...
std::string signal_name(int sig);

/// Thrown by a run that stopped on a signal after its step; the program exits 128 + signal.
class Interrupted : public std::runtime_error {
 public:
  Interrupted(int sig, const std::string& what) : std::runtime_error(what), signal_(sig) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

}  // namespace fusebox::trainer
