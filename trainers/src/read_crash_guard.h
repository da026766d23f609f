// Turns a crash of LibTorch's file readers on a malformed file into the one error line that
// file gets.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <string>

namespace fusebox::trainer {

// LibTorch's unpickler does not check a malformed file's opcodes against its stack (1.13 dies of
// SIGSEGV on a REDUCE or BUILD with nothing to apply it to). While a file is read, such a fault
// ends the program with the one line a bad file gets (exit 2: nothing has trained or been written
// yet) instead of a crash. Only async-signal-safe calls run in the handler.
class ReadCrashGuard {
 public:
  explicit ReadCrashGuard(const std::string& line) {
    std::strncpy(message_, line.c_str(), sizeof(message_) - 2);
    message_[sizeof(message_) - 2] = '\n';
    stack_t alt{};
    alt.ss_sp = alt_stack_;  // deep recursion in the reader overflows the normal stack
    alt.ss_size = sizeof(alt_stack_);
    ::sigaltstack(&alt, &old_stack_);
    struct sigaction sa {};
    sa.sa_handler = on_fault;
    sa.sa_flags = SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &old_segv_);
    ::sigaction(SIGBUS, &sa, &old_bus_);
  }
  ~ReadCrashGuard() {
    ::sigaction(SIGSEGV, &old_segv_, nullptr);
    ::sigaction(SIGBUS, &old_bus_, nullptr);
    ::sigaltstack(&old_stack_, nullptr);
  }
  ReadCrashGuard(const ReadCrashGuard&) = delete;
  ReadCrashGuard& operator=(const ReadCrashGuard&) = delete;

 private:
  static void on_fault(int) {
    const ssize_t ignored = ::write(STDERR_FILENO, message_, ::strnlen(message_, sizeof(message_)));
    (void)ignored;
    ::_exit(2);
  }
  static inline char message_[1024] = {};
  static inline char alt_stack_[1 << 16] = {};
  stack_t old_stack_{};
  struct sigaction old_segv_ {
  }, old_bus_{};
};

/// For the program's life: the data and weights files (and a checkpoint while it is loaded) are
/// mapped into memory, and one shortened while in use (rewritten by another program) raises
/// SIGBUS at the next touch of a page past its new end. The program then ends with one line,
/// exit 3, instead of "Bus error" and a core dump. A ReadCrashGuard replaces the handler while it
/// reads and puts it back.
inline void install_mapped_file_fault_handler() {
  struct sigaction sa {};
  sa.sa_handler = [](int) {
    static const char line[] =
        "trainer: error: a file mapped into memory (the --dataset, --eval-dataset or "
        "--init-weights file, or a checkpoint being resumed) was shortened while this process "
        "read it (SIGBUS): the run cannot go on; give the file back whole and --resume from the "
        "last checkpoint\n";
    const ssize_t ignored = ::write(STDERR_FILENO, line, sizeof(line) - 1);
    (void)ignored;
    ::_exit(3);
  };
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace fusebox::trainer
