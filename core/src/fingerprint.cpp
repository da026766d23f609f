#include "fusebox/core/fingerprint.h"

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "fusebox/error.h"

namespace fusebox {

uint64_t fnv1a(const void* data, size_t n, uint64_t h) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= bytes[i];
    h *= 1099511628211ULL;
  }
  return h;
}

std::string FileFingerprint::text() const {
  char out[64];
  std::snprintf(out, sizeof out, "%" PRIu64 ":%s%016" PRIx64, size, sampled ? "~" : "", hash);
  return out;
}

bool FileFingerprint::parse(const std::string& text, FileFingerprint& out) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos || colon == 0) return false;
  FileFingerprint f;
  size_t at = colon + 1;
  f.sampled = at < text.size() && text[at] == '~';
  if (f.sampled) ++at;
  if (text.size() - at != 16) return false;
  for (size_t i = 0; i < colon; ++i)
    if (text[i] < '0' || text[i] > '9') return false;
  for (size_t i = at; i < text.size(); ++i)
    if (!std::isxdigit(static_cast<unsigned char>(text[i]))) return false;
  f.size = std::strtoull(text.substr(0, colon).c_str(), nullptr, 10);
  f.hash = std::strtoull(text.substr(at).c_str(), nullptr, 16);
  out = f;
  return true;
}

FileFingerprint file_fingerprint(const std::string& path, uint64_t blocks) {
  constexpr uint64_t kBlock = 64 << 10;
  blocks = std::max<uint64_t>(blocks, 2);  // the first and the last at least
  const uint64_t whole = 2 * blocks * kBlock;
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error("data file " + path + " cannot be read");
  FileFingerprint f;
  f.size = static_cast<uint64_t>(in.tellg());
  f.sampled = f.size > whole;
  f.hash = fnv1a(&f.size, sizeof f.size);
  std::vector<char> block(f.sampled ? kBlock : f.size);
  auto take = [&](uint64_t offset) {
    in.seekg(static_cast<std::streamoff>(offset));
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    if (in.gcount() != static_cast<std::streamsize>(block.size()))
      throw Error("data file " + path + " cannot be read (it changed while it was read)");
    f.hash = fnv1a(block.data(), block.size(), f.hash);
  };
  if (!f.sampled) {
    take(0);
  } else {
    for (uint64_t i = 0; i < blocks; ++i) take(i * (f.size - kBlock) / (blocks - 1));
  }
  return f;
}

}  // namespace fusebox
