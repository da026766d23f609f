// The trainer program; everything but argument passing lives in fusebox_trainer_lib.
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "app.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return fusebox::trainer::trainer_main(args, std::cout, std::cerr, ::isatty(STDOUT_FILENO) != 0);
}
