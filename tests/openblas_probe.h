// Whether OpenBLAS is LibTorch's BLAS in this process, told independently of fusebox's own
// lookup: tests of the thread settings assert OpenBLAS's thread count only where it is there.
#pragma once

#include <fstream>
#include <string>

namespace fusebox::testing {

/// True when OpenBLAS is mapped into this process (Debian's LibTorch reaches it through
/// libblas.so.3; the trainer links the same LibTorch as the tests).
inline bool openblas_loaded() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find("openblas") != std::string::npos) return true;
  return false;
}

}  // namespace fusebox::testing
