#include "interrupt.h"

#include <signal.h>
#include <time.h>

#include <atomic>
#include <cstdint>

namespace fusebox::trainer {

namespace {

// Lock-free atomics are safe to use in a signal handler.
std::atomic<int> g_signal{0};
std::atomic<int64_t> g_first_ms{0};  // CLOCK_MONOTONIC milliseconds of the first signal
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free);

void on_signal(int sig) {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  const int64_t ms = static_cast<int64_t>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
  if (g_signal.load() != 0) {
    if (ms - g_first_ms.load() >= 1000) {
      ::signal(sig, SIG_DFL);  // asked again: stop now
      ::raise(sig);
    }
    return;
  }
  g_first_ms.store(ms);
  g_signal.store(sig);
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;  // reads, writes and waits go on; the loop looks at the flag
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  // The terminal closed (an ssh session dropped): a run started without nohup would die at once
  // and lose the steps since its last checkpoint.
  ::sigaction(SIGHUP, &sa, nullptr);
}

int interrupt_signal() { return g_signal.load(); }

std::string signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  if (sig == SIGHUP) return "SIGHUP";
  return "signal " + std::to_string(sig);
}

}  // namespace fusebox::trainer
