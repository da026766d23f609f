// libFuzzer target: any bytes read as a safetensors file must give a fusebox::Error or tensors,
// never a crash or an allocation beyond the input's size. Two views per input: the raw file, and
// the input as the JSON header of a file with 64 bytes of data behind it (so the header's
// decoder is reached without the fuzzer having to find a consistent size prefix first).
#include <cstdint>
#include <string>

#include "fusebox/core/safetensors.h"
#include "fusebox/error.h"

namespace {
void try_parse(const std::string& bytes) {
  try {
    fusebox::parse_safetensors(bytes, "fuzz");
  } catch (const fusebox::Error&) {
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  try_parse(raw);
  std::string framed(8, '\0');
  for (int i = 0; i < 8; ++i) framed[i] = static_cast<char>((uint64_t{size} >> (8 * i)) & 0xFF);
  framed += raw;
  framed.append(64, '\x01');
  try_parse(framed);
  return 0;
}
