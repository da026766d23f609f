// libFuzzer target for the tensor file readers: any bytes read as a safetensors, .npy or .npz file
// (np.savez_compressed's deflated entries too) must give a fusebox::Error or tensors, never a crash
// or an allocation beyond what the input's size can hold (for a deflated entry, 1032 bytes per
// byte).
// Each reader gets two views per input: the raw file, and the input as the header of a file with
// 64 bytes of data behind it (so the header's decoder is reached without the fuzzer having to
// find a consistent size prefix first).
#include <cstdint>
#include <string>

#include "fusebox/core/npy.h"
#include "fusebox/core/safetensors.h"
#include "fusebox/error.h"

namespace {
template <class Parse>
void try_parse(Parse parse, const std::string& bytes) {
  try {
    parse(bytes, "fuzz");
  } catch (const fusebox::Error&) {
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string raw(reinterpret_cast<const char*>(data), size);
  const auto safetensors = [](const std::string& b, const std::string& w) {
    fusebox::parse_safetensors(b, w);
  };
  const auto npy = [](const std::string& b, const std::string& w) { fusebox::parse_npy(b, w); };
  try_parse(safetensors, raw);
  try_parse(npy, raw);
  try_parse([](const std::string& b, const std::string& w) { fusebox::parse_npz(b, w); }, raw);
  std::string framed(8, '\0');
  for (int i = 0; i < 8; ++i) framed[i] = static_cast<char>((uint64_t{size} >> (8 * i)) & 0xFF);
  framed += raw;
  framed.append(64, '\x01');
  try_parse(safetensors, framed);
  std::string npy_framed = "\x93NUMPY\x02";
  npy_framed += '\0';
  for (int i = 0; i < 4; ++i) npy_framed += static_cast<char>((uint64_t{size} >> (8 * i)) & 0xFF);
  npy_framed += raw;
  npy_framed.append(64, '\x01');
  try_parse(npy, npy_framed);
  return 0;
}
