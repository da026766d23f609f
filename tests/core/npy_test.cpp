// NumPy's .npy format: files laid out as np.save writes them (versions 1 and 2, C and Fortran
// order, every dtype read, uint16/uint32 widened), mapped or parsed alike, and one Error naming the
// fault for each way a file can be wrong. And .npz archives: one np.savez wrote
// (tests/data/numpy-savez.npz), the same deflated by np.savez_compressed, ZIP64 ones laid out by
// hand, the faults of an archive and of a compressed entry, and CRC-32s checked on request.
#include "fusebox/core/npy.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>

#include "../error_of.h"
#include "../scratch_dir.h"
#include "fusebox/core/zip_archive.h"

using namespace fusebox;
using fusebox::testing::error_of;
using fusebox::testing::file_bytes;
using fusebox::testing::ScratchDir;

namespace {

// A file as np.save writes it: magic, version, header size, the dict padded with spaces to a
// multiple of 64 bytes (ending in a newline), then `data`.
std::string npy(const std::string& dict, const std::string& data, int version = 1) {
  const size_t prefix = version == 1 ? 10 : 12;
  std::string header = dict;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  for (size_t i = 0; i < prefix - 8; ++i)
    out += static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  return out + header + data;
}

void put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

// A zip archive of stored entries, as np.savez writes one; with `zip64`, every size and offset of
// the central directory is in a ZIP64 extra field, and a ZIP64 end record and locator come first.
std::string zip_of(const std::vector<std::pair<std::string, std::string>>& files, bool zip64) {
  std::string out, dir;
  for (const auto& [name, data] : files) {
    const uint64_t local = out.size();
    put(out, 0x04034b50, 4), put(out, 20, 2), put(out, 0, 2), put(out, 0, 2);
    put(out, 0, 8), put(out, data.size(), 4), put(out, data.size(), 4);
    put(out, name.size(), 2), put(out, 0, 2);
    out += name + data;
    put(dir, 0x02014b50, 4), put(dir, 45, 2), put(dir, 45, 2), put(dir, 0, 2);
    put(dir, 0, 2), put(dir, 0, 8);
    put(dir, zip64 ? 0xFFFFFFFF : data.size(), 4), put(dir, zip64 ? 0xFFFFFFFF : data.size(), 4);
    put(dir, name.size(), 2), put(dir, zip64 ? 28 : 0, 2), put(dir, 0, 2), put(dir, 0, 8);
    put(dir, zip64 ? 0xFFFFFFFF : local, 4);
    dir += name;
    if (zip64)
      put(dir, 1, 2), put(dir, 24, 2), put(dir, data.size(), 8), put(dir, data.size(), 8),
          put(dir, local, 8);
  }
  const uint64_t dir_at = out.size();
  out += dir;
  if (zip64) {
    const uint64_t record = out.size();
    put(out, 0x06064b50, 4), put(out, 44, 8), put(out, 45, 2), put(out, 45, 2), put(out, 0, 8);
    put(out, files.size(), 8), put(out, files.size(), 8), put(out, dir.size(), 8);
    put(out, dir_at, 8);
    put(out, 0x07064b50, 4), put(out, 0, 4), put(out, record, 8), put(out, 1, 4);
  }
  put(out, 0x06054b50, 4), put(out, 0, 4), put(out, files.size(), 2), put(out, files.size(), 2);
  put(out, dir.size(), 4), put(out, zip64 ? 0xFFFFFFFF : dir_at, 4), put(out, 0, 2);
  return out;
}

template <class T>
std::string raw(std::initializer_list<T> values) {
  std::string out;
  for (const T v : values) out.append(reinterpret_cast<const char*>(&v), sizeof v);
  return out;
}

}  // namespace

TEST(Npy, ReadsWhatNumpyWrites) {
  const std::string c_order = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                                  raw<float>({1, 2, 3, 4, 5, 6}));
  EXPECT_TRUE(looks_like_npy(c_order));
  EXPECT_FALSE(looks_like_npy("PK\x03\x04"));
  at::Tensor t = parse_npy(c_order, "c");
  EXPECT_TRUE(at::equal(t, at::arange(1, 7, at::kFloat).view({2, 3})));
  // Fortran order: the same values stored column by column.
  t = parse_npy(npy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                    raw<float>({1, 4, 2, 5, 3, 6})),
                "f");
  EXPECT_TRUE(at::equal(t, at::arange(1, 7, at::kFloat).view({2, 3})));
  // Version 2 (a 4-byte header size), a 1-d shape written "(5,)", keys in another order.
  t = parse_npy(npy("{'shape': (5,), 'fortran_order': False, 'descr': '<i8'}",
                    raw<int64_t>({-2, -1, 0, 1, 1LL << 40}), 2),
                "v2");
  EXPECT_TRUE(at::equal(t, at::tensor(std::vector<int64_t>{-2, -1, 0, 1, int64_t{1} << 40})));
  // A scalar (shape ()), and an empty array.
  EXPECT_EQ(
      parse_npy(npy("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", raw<double>({2.5})),
                "s")
          .item<double>(),
      2.5);
  EXPECT_EQ(parse_npy(npy("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 4), }", ""), "e")
                .sizes(),
            (at::IntArrayRef{0, 4}));
  // Every dtype: its type, and uint16/uint32 widened with their values.
  struct Case {
    std::string descr, data;
    at::Tensor want;
  };
  const std::vector<Case> cases = {
      {"<f8", raw<double>({-1.5, 2}), at::tensor({-1.5, 2.0}, at::kDouble)},
      {"<f2", raw<uint16_t>({0x3C00, 0xC000}), at::tensor({1.0, -2.0}).to(at::kHalf)},
      {"<i4", raw<int32_t>({-7, 1 << 30}), at::tensor({-7, 1 << 30}, at::kInt)},
      {"<i2", raw<int16_t>({-300, 300}), at::tensor({-300, 300}, at::kShort)},
      {"|i1", raw<int8_t>({-128, 127}), at::tensor({-128, 127}, at::kChar)},
      {"|u1", raw<uint8_t>({0, 255}), at::tensor({0, 255}, at::kByte)},
      {"|b1", raw<uint8_t>({1, 0}), at::tensor({1, 0}, at::kByte).to(at::kBool)},
      {"<u2", raw<uint16_t>({65535, 50256}), at::tensor({65535, 50256}, at::kInt)},
      {"<u4", raw<uint32_t>({4294967295u, 7}), at::tensor({int64_t{4294967295}, int64_t{7}})}};
  for (const Case& c : cases) {
    const at::Tensor got = parse_npy(
        npy("{'descr': '" + c.descr + "', 'fortran_order': False, 'shape': (2,), }", c.data), "d");
    EXPECT_EQ(got.scalar_type(), c.want.scalar_type()) << c.descr;
    EXPECT_TRUE(at::equal(got, c.want)) << c.descr;
  }
}

// A mapped file gives what a parsed one gives, C or Fortran order, and the tensor outlives the
// call (the mapping stays while a tensor views it).
TEST(Npy, AMappedFileGivesWhatAParseGives) {
  ScratchDir dir("npy");
  for (const std::string order : {"False", "True"}) {
    const std::string bytes =
        npy("{'descr': '<f4', 'fortran_order': " + order + ", 'shape': (3, 2), }",
            raw<float>({1, 2, 3, 4, 5, 6}));
    const std::string path = (dir.path() / "a.npy").string();
    std::ofstream(path, std::ios::binary) << bytes;
    const at::Tensor mapped = map_npy(path);
    EXPECT_TRUE(at::equal(mapped, parse_npy(bytes, "mem"))) << order;
    EXPECT_EQ(mapped.is_contiguous(), order == "False");
    mapped.add_(1);  // copy-on-write: the file keeps its values
    EXPECT_TRUE(at::equal(map_npy(path) + 1, mapped));
  }
  const std::string missing = (dir.path() / "missing.npy").string();
  EXPECT_EQ(error_of([&] { map_npy(missing); }), missing + " does not exist");
}

TEST(Npy, EveryBadFileIsOneErrorNamingTheFault) {
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  const std::string two = raw<float>({1, 2});
  auto error = [](const std::string& bytes) {
    return error_of([&] { parse_npy(bytes, "x.npy"); });
  };
  const std::string bad = "x.npy: not a valid .npy file: ";
  EXPECT_EQ(error("PK\x03\x04 a zip"), "x.npy: not a .npy file (no \\x93NUMPY magic string)");
  EXPECT_EQ(error("\x93NUM"), "x.npy: not a .npy file (no \\x93NUMPY magic string)");
  std::string v4 = npy(good, two);
  v4[6] = 4;
  EXPECT_EQ(error(v4), bad + "format version 4 is not 1, 2 or 3");
  std::string huge = npy(good, two);
  huge[8] = '\xff', huge[9] = '\xff';
  EXPECT_EQ(error(huge), bad + "its header size 65535 is larger than the file (a truncated file?)");
  EXPECT_EQ(error(npy(good, raw<float>({1}))),
            bad + "its data are 4 bytes, its dtype and shape need 8 (a truncated file?)");
  EXPECT_EQ(error(npy(good, raw<float>({1, 2, 3}))),
            bad + "its data are 12 bytes, its dtype and shape need 8");
  EXPECT_EQ(error(npy("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", two)),
            bad +
                "its dtype '>f4' is big-endian; save it little-endian "
                "(array.astype(array.dtype.newbyteorder('<')))");
  EXPECT_EQ(error(npy("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", two)),
            bad +
                "its dtype '|O' is not one fusebox reads (float64, float32, float16, int64, int32, "
                "int16, int8, uint8, uint16, uint32, bool)");
  EXPECT_EQ(error(npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", two)),
            bad + "it holds a structured array (fields), which fusebox does not read");
  EXPECT_EQ(error(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", two)),
            bad + "its header has the key 'x', not one of descr, fortran_order, shape");
  EXPECT_EQ(error(npy("{'descr': '<f4', 'shape': (2,), }", two)),
            bad + "its header lacks fortran_order");
  EXPECT_EQ(error(npy("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,), }", two)),
            bad + "its fortran_order is neither True nor False");
  EXPECT_EQ(error(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", two)),
            bad + "its shape holds something other than sizes");
  EXPECT_EQ(error(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", two)),
            bad + "its header is not a dict numpy writes (expected ',')");
  EXPECT_EQ(error(npy("{'descr': '<f4', 'fortran_order': False, 'shape': (461168601842738790, "
                      "4), }",
                      two)),
            bad + "its shape holds more bytes than any file");
  EXPECT_EQ(
      error(npy("{'descr': '|b1', 'fortran_order': False, 'shape': (2,), }", raw<uint8_t>({1, 2}))),
      bad + "a bool array holds a byte other than 0 or 1");
  EXPECT_EQ(error(npy("{'descr': '<f4", two)), bad + "its header has an unterminated string");
}

// What np.savez wrote (NumPy 1.24: stored entries with ZIP64 local extras, a Fortran-ordered
// array, a uint16 one) reads by name, mapped or parsed alike.
TEST(Npz, ReadsWhatNumpySavezWrites) {
  const std::string path = FUSEBOX_TEST_DATA "/numpy-savez.npz";
  const std::string bytes = file_bytes(path);
  EXPECT_TRUE(looks_like_npz(bytes.substr(0, 64)));
  EXPECT_FALSE(looks_like_npz(zip_of({{"archive/data.pkl", "x"}}, false)));  // torch.save's zip
  for (const auto& arrays : {map_npz(path), parse_npz(bytes, "mem")}) {
    ASSERT_EQ(arrays.size(), 4u);
    EXPECT_TRUE(at::equal(arrays.at("input"), at::arange(8, at::kFloat).view({4, 2})));
    EXPECT_TRUE(at::equal(arrays.at("target"), at::tensor({0.5, -1.0, 2.0, 3.5}, at::kDouble)));
    EXPECT_TRUE(at::equal(arrays.at("ids"), at::tensor({0, 65535, 50256}, at::kInt)));
    EXPECT_TRUE(at::equal(arrays.at("grid"), at::arange(6, at::kInt).view({2, 3})));
  }
}

TEST(Npz, AZip64ArchiveReadsAndEveryBadArchiveIsOneError) {
  const std::string a =
      npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", raw<float>({1, 2}));
  const std::string b =
      npy("{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", raw<uint8_t>({7, 8, 9}));
  for (const bool zip64 : {false, true}) {
    const auto arrays = parse_npz(zip_of({{"a.npy", a}, {"b.npy", b}}, zip64), "z");
    ASSERT_EQ(arrays.size(), 2u) << zip64;
    EXPECT_TRUE(at::equal(arrays.at("a"), at::tensor({1.0f, 2.0f})));
    EXPECT_TRUE(at::equal(arrays.at("b"), at::tensor({7, 8, 9}, at::kByte)));
  }
  auto error = [](const std::string& bytes) {
    return error_of([&] { parse_npz(bytes, "z.npz"); });
  };
  const std::string bad = "z.npz: not a valid .npz file: ";
  EXPECT_EQ(error(zip_of({{"a.npy", a}, {"notes.txt", "x"}}, false)),
            bad + "it holds 'notes.txt', which is not a .npy file");
  EXPECT_EQ(error(zip_of({{"a.npy", a}, {"a.npy", a}}, false)), bad + "it holds 'a.npy' twice");
  EXPECT_EQ(error(zip_of({}, false)), "z.npz: the .npz file holds no arrays");
  EXPECT_EQ(error("PK\x03\x04"), bad + "it is shorter than a zip archive's end record");
  const std::string whole = zip_of({{"a.npy", a}}, false);
  EXPECT_EQ(error(whole.substr(0, whole.size() - 30) + std::string(30, ' ')),
            bad + "it has no zip end record");
  // Cut inside the data: the directory (at the end) still points to where the data were.
  std::string cut = whole;
  cut.erase(40, 20);
  EXPECT_NE(error(cut).find(bad), std::string::npos);
  std::string wrong_array = zip_of({{"a.npy", a.substr(0, a.size() - 4)}}, true);
  EXPECT_EQ(error(wrong_array),
            "z.npz 'a': not a valid .npy file: its data are 4 bytes, its dtype and shape need 8 (a "
            "truncated file?)");
  std::string far = zip_of({{"a.npy", a}}, true);
  far[far.size() - 22 - 20 - 56 + 55] = '\x7f';  // the ZIP64 directory offset, far past the end
  EXPECT_EQ(error(far), bad +
                            "its central directory lies past the end of the file (a truncated "
                            "file?)");
}

// What np.savez_compressed wrote (the same four arrays as numpy-savez.npz, deflated) reads as
// np.savez's archive does, each array inflated into memory of its own; a build without zlib
// refuses it in one line.
TEST(Npz, ReadsWhatNumpySavezCompressedWrites) {
  const std::string path = FUSEBOX_TEST_DATA "/numpy-savez-compressed.npz";
  const std::string bytes = file_bytes(path);
  EXPECT_TRUE(looks_like_npz(bytes.substr(0, 64)));
#ifdef FUSEBOX_WITH_ZLIB
  const auto stored = map_npz(FUSEBOX_TEST_DATA "/numpy-savez.npz");
  for (const auto& arrays : {map_npz(path), parse_npz(bytes, "mem")}) {
    ASSERT_EQ(arrays.size(), stored.size());
    for (const auto& [name, t] : stored) {
      EXPECT_TRUE(at::equal(arrays.at(name), t)) << name;
      EXPECT_EQ(arrays.at(name).strides(), t.strides()) << name;  // grid is Fortran-ordered
    }
  }
  // Unsigned ids kept in their carrier, as from a stored archive.
  UnsignedTypes types;
  const auto carried = map_npz(path, &types);
  ASSERT_EQ(types.size(), 1u);
  EXPECT_EQ(carried.at("ids").scalar_type(), at::kShort);
  EXPECT_TRUE(at::equal(widen_unsigned(carried.at("ids"), types.at("ids")), stored.at("ids")));
#else
  EXPECT_EQ(error_of([&] { parse_npz(bytes, "z.npz"); }),
            "z.npz: not a valid .npz file: 'input.npy' is compressed, and this fusebox was built "
            "without zlib (install zlib's headers, e.g. zlib1g-dev, and rebuild; or store the "
            "entries uncompressed)");
#endif
}

#ifdef FUSEBOX_WITH_ZLIB
// A damaged compressed entry is one error naming it: a wrong CRC-32, deflated bytes that do not
// inflate, a declared size the data do not fill or one larger than deflate can hold (refused
// before it is allocated), another compression method.
TEST(Npz, EveryDamagedCompressedEntryIsOneError) {
  const std::string good = file_bytes(FUSEBOX_TEST_DATA "/numpy-savez-compressed.npz");
  // The central directory's entry of the first array, input.npy, and where its data start.
  const size_t entry = good.find("PK\x01\x02");
  ASSERT_NE(entry, std::string::npos);
  ASSERT_EQ(good.substr(entry + 46, 9), "input.npy");
  const size_t data = 30 + 9 + static_cast<unsigned char>(good[28]);  // local header, name, extra
  auto error = [](const std::string& bytes) {
    return error_of([&] { parse_npz(bytes, "z.npz"); });
  };
  // Sets the `bytes`-byte little-endian field at `at` of a copy of the archive.
  auto with = [&](size_t at, uint64_t value, int bytes) {
    std::string out = good;
    for (int i = 0; i < bytes; ++i) out[at + i] = static_cast<char>((value >> (8 * i)) & 0xFF);
    return out;
  };
  const std::string bad = "z.npz: not a valid .npz file: 'input.npy' ";
  std::string crc = good;
  crc[entry + 16] = static_cast<char>(crc[entry + 16] ^ 1);  // the CRC-32's lowest bit
  EXPECT_EQ(error(crc), bad + "is damaged: its content does not match its CRC-32");
  std::string flipped = good;
  flipped[data + 20] = static_cast<char>(flipped[data + 20] ^ 0x55);
  EXPECT_EQ(error(flipped).rfind(bad + "is damaged: ", 0), 0u) << error(flipped);
  const uint64_t size = 128 + 32;  // input.npy: its 128-byte header and 8 float32s
  EXPECT_EQ(error(with(entry + 24, size - 1, 4)),
            bad +
                "is damaged: its deflated data do not inflate into the 159 bytes it declares "
                "(a truncated file?)");
  EXPECT_EQ(error(with(entry + 24, size + 1, 4)),
            bad +
                "is damaged: its deflated data do not inflate into the 161 bytes it declares "
                "(a truncated file?)");
  const std::string huge = error(with(entry + 24, 0x7FFFFFFF, 4));
  EXPECT_EQ(huge.rfind(bad + "claims 2147483647 bytes from ", 0), 0u) << huge;
  EXPECT_NE(huge.find(" compressed, more than deflate can hold"), std::string::npos) << huge;
  EXPECT_EQ(error(with(entry + 10, 12, 2)),
            bad + "is compressed with method 12, not deflate (the only one read)");
}
#endif

// check_zip_crcs reads every entry of an archive against its CRC-32, stored and deflated alike:
// a changed byte, and a stored entry whose declared sizes differ, are named with the entry.
TEST(ZipArchive, EveryEntryIsCheckedAgainstItsCrc) {
  const std::string stored = FUSEBOX_TEST_DATA "/numpy-savez.npz";
  if (!zlib_available()) {
    EXPECT_EQ(error_of([&] { check_zip_crcs(stored); }),
              stored + ": its CRC-32s cannot be checked: this fusebox was built without zlib");
    return;
  }
  EXPECT_EQ(check_zip_crcs(stored), 4);
  EXPECT_EQ(check_zip_crcs(FUSEBOX_TEST_DATA "/numpy-savez-compressed.npz"), 4);
  ScratchDir dir("zip-crc");
  const std::string path = dir.file("d.npz");
  const std::string good = file_bytes(stored);
  auto error = [&](const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    return error_of([&] { check_zip_crcs(path); });
  };
  // The last byte of the first array's data (input.npy's 7.0f): still a valid archive and array.
  const size_t entry = good.find("PK\x01\x02");
  ASSERT_EQ(good.substr(entry + 46, 9), "input.npy");
  std::string changed = good;
  const size_t last = good.find("PK\x03\x04", 4) - 1;  // the byte before the second entry
  changed[last] = static_cast<char>(changed[last] ^ 1);
  EXPECT_EQ(error(changed),
            path + ": 'input.npy' is damaged: its content does not match its CRC-32");
  std::string sizes = good;
  sizes[entry + 24] = static_cast<char>(sizes[entry + 24] + 1);  // its declared content size
  EXPECT_EQ(error(sizes),
            path + ": 'input.npy' is damaged: it is stored in 160 bytes and declares 161");
  EXPECT_EQ(error("not a zip"), path + ": it is shorter than a zip archive's end record");
}

// A headerless file (numpy's tofile) is one array of the type named: viewed in the mapped file,
// unsigned ones kept in their carriers when asked, a size that is no whole number of values and
// an empty file refused.
TEST(Npy, AHeaderlessFileIsOneArrayOfTheTypeNamed) {
  ScratchDir dir("npy-raw");
  const std::string path = dir.file("ids.bin");
  const uint16_t ids[] = {0, 1, 32767, 32768, 65535, 50256};
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(ids), sizeof ids);
  EXPECT_TRUE(at::equal(map_raw_array(path, "uint16"),
                        at::tensor({0, 1, 32767, 32768, 65535, 50256}, at::kInt)));
  at::ScalarType widens = at::ScalarType::Undefined;
  const at::Tensor kept = map_raw_array(path, "uint16", &widens);
  EXPECT_EQ(kept.scalar_type(), at::kShort);
  EXPECT_EQ(widens, at::kInt);
  EXPECT_EQ(kept[3].item<int64_t>(), -32768);  // 32768 in its carrier
  EXPECT_TRUE(at::equal(map_raw_array(path, "float32"),
                        at::from_blob(const_cast<uint16_t*>(ids), {3}, at::kFloat)));
  EXPECT_EQ(error_of([&] { map_raw_array(path, "int64"); }),
            path +
                ": a headerless file of int64 values, and its 12 bytes are not a whole number "
                "of 8-byte values");
  EXPECT_EQ(error_of([&] { map_raw_array(path, "uint64"); }),
            path +
                ": 'uint64' is not a type a headerless file is read as (uint16, uint32, int16, "
                "int32, int64, uint8, int8, float32, float64)");
  std::ofstream(dir.file("empty.bin"));
  EXPECT_EQ(error_of([&] { map_raw_array(dir.file("empty.bin"), "uint16"); }),
            dir.file("empty.bin") + " is empty: it holds no uint16 value");
}
