// File fingerprints: what they notice (any byte of a small file, a size change, a change in a
// sampled block of a large file), that they are stable, and that their text reads back.
#include "fusebox/core/fingerprint.h"

#include <gtest/gtest.h>

#include <fstream>

#include "../error_of.h"
#include "../scratch_dir.h"

using namespace fusebox;
using fusebox::testing::error_of;
using fusebox::testing::ScratchDir;

namespace {

std::string write(const ScratchDir& dir, const std::string& name, const std::string& bytes) {
  const std::string path = (dir.path() / name).string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

}  // namespace

TEST(Fingerprint, FnvMatchesItsPublishedValuesAndContinues) {
  // The FNV-1a 64 test vectors ("" and "a", from the algorithm's authors).
  EXPECT_EQ(fnv1a("", 0), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a("a", 1), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(fnv1a("bc", 2, fnv1a("a", 1)), fnv1a("abc", 3));  // a hash goes on where it stopped
}

TEST(Fingerprint, ASmallFileIsHashedWhole) {
  ScratchDir dir("fingerprint");
  std::string bytes(100000, 'x');
  const FileFingerprint a = file_fingerprint(write(dir, "a", bytes));
  EXPECT_EQ(a.size, 100000u);
  EXPECT_FALSE(a.sampled);
  EXPECT_EQ(file_fingerprint(write(dir, "same", bytes)), a);  // the content, not the name
  for (size_t at : {size_t{0}, size_t{54321}, bytes.size() - 1}) {
    std::string changed = bytes;
    changed[at] = 'y';
    EXPECT_NE(file_fingerprint(write(dir, "b", changed)).hash, a.hash) << at;
  }
  EXPECT_EQ(file_fingerprint(write(dir, "empty", "")).size, 0u);
}

TEST(Fingerprint, ALargeFileIsSampledAndAnySizeChangeIsSeen) {
  ScratchDir dir("fingerprint");
  std::string bytes(9 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 2654435761u >> 13);
  const FileFingerprint a = file_fingerprint(write(dir, "a", bytes));
  EXPECT_TRUE(a.sampled);
  EXPECT_EQ(a.size, bytes.size());
  std::string changed = bytes;
  changed[0] ^= 1;  // the first block
  EXPECT_NE(file_fingerprint(write(dir, "b", changed)).hash, a.hash);
  changed = bytes;
  changed.back() ^= 1;  // the last block
  EXPECT_NE(file_fingerprint(write(dir, "b", changed)).hash, a.hash);
  // A byte between two blocks is not read: the price of reading 4 MiB of any file.
  changed = bytes;
  changed[(64 << 10) + 100] ^= 1;
  EXPECT_EQ(file_fingerprint(write(dir, "b", changed)).hash, a.hash);
  // One byte more or less is always seen.
  EXPECT_NE(file_fingerprint(write(dir, "b", bytes + "!")).size, a.size);
  EXPECT_NE(file_fingerprint(write(dir, "b", bytes.substr(1))).hash, a.hash);
}

// Fewer blocks (a folder's files share the 64 out): whole up to 2 x blocks x 64 KiB, and beyond,
// at least the first and the last block.
TEST(Fingerprint, FewerBlocksReadLessAndStillTheEnds) {
  ScratchDir dir("fingerprint");
  const std::string small(256 << 10, 'x'), large(1 << 20, 'x');
  EXPECT_FALSE(file_fingerprint(write(dir, "small", small), 2).sampled);
  const FileFingerprint a = file_fingerprint(write(dir, "a", large), 2);
  EXPECT_TRUE(a.sampled);
  EXPECT_EQ(file_fingerprint(write(dir, "a0", large), 0), a);  // 0 and 1 read two blocks too
  for (const size_t at : {size_t{0}, large.size() - 1}) {
    std::string changed = large;
    changed[at] = 'y';
    EXPECT_NE(file_fingerprint(write(dir, "b", changed), 2).hash, a.hash) << at;
  }
  std::string middle = large;
  middle[large.size() / 2] = 'y';  // between the two blocks
  EXPECT_EQ(file_fingerprint(write(dir, "b", middle), 2).hash, a.hash);
  EXPECT_NE(file_fingerprint(write(dir, "b", middle)).hash, a.hash);  // 64 blocks: 1 MiB is whole
}

TEST(Fingerprint, TextReadsBackAndMalformedTextIsRefused) {
  ScratchDir dir("fingerprint");
  for (const FileFingerprint f : {FileFingerprint{12, 0xabcdef, false},
                                  FileFingerprint{uint64_t{1} << 40, ~uint64_t{0}, true}}) {
    FileFingerprint back;
    ASSERT_TRUE(FileFingerprint::parse(f.text(), back)) << f.text();
    EXPECT_EQ(back, f) << f.text();
  }
  EXPECT_EQ((FileFingerprint{12, 0xabcdef, false}.text()), "12:0000000000abcdef");
  EXPECT_EQ((FileFingerprint{12, 0xabcdef, true}.text()), "12:~0000000000abcdef");
  FileFingerprint out;
  for (const char* bad : {"", "12", ":0000000000abcdef", "x:0000000000abcdef", "12:abc",
                          "12:000000000000abcdefg", "12:~~000000000abcdef"})
    EXPECT_FALSE(FileFingerprint::parse(bad, out)) << bad;
  const std::string missing = (dir.path() / "missing").string();
  EXPECT_EQ(error_of([&] { file_fingerprint(missing); }),
            "data file " + missing + " cannot be read");
}
