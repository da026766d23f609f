// The trainer program; everything but argument passing lives in fusebox_trainer_lib.
#include <malloc.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "app.h"
#include "interrupt.h"
#include "launch.h"
#include "read_crash_guard.h"

int main(int argc, char** argv) {
  // Keep freed tensor memory in the process: otherwise glibc unmaps and re-maps large blocks
  // each step (page faults), which costs more in some step modes than in others.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  fusebox::trainer::allow_self_launch();
  fusebox::trainer::install_interrupt_handlers();
  fusebox::trainer::install_mapped_file_fault_handler();
  std::vector<std::string> args(argv + 1, argv + argc);
  return fusebox::trainer::trainer_main(args, std::cout, std::cerr, ::isatty(STDOUT_FILENO) != 0);
}
