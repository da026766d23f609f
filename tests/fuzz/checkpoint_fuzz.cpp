// libFuzzer target: any bytes given as a checkpoint file must give a fusebox::Error or a
// checkpoint, never a crash. Three views per input: the raw file, and the input as a payload
// behind a valid header of format version 1 and of version 2 (tensor data aligned to 64 bytes),
// so that the decoder behind the checksum is exercised in both layouts.
#include <cstdint>
#include <cstring>
#include <string>

#include "fusebox/core/checkpoint.h"

namespace {
uint64_t fnv1a(const char* data, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(data[i])) * 1099511628211ULL;
  return h;
}
void try_parse(const std::string& bytes) {
  try {
    fusebox::parse_checkpoint(bytes, "fuzz");
  } catch (const fusebox::Error&) {
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  try_parse(raw);
  const uint64_t n = size, sum = fnv1a(raw.data(), raw.size());
  for (const uint32_t version : {1u, 2u}) {
    std::string framed("FUSEBOX-CKPT", 12);
    framed.append(reinterpret_cast<const char*>(&version), 4);
    framed.append(reinterpret_cast<const char*>(&n), 8);
    framed.append(reinterpret_cast<const char*>(&sum), 8);
    framed += raw;
    try_parse(framed);
  }
  return 0;
}
