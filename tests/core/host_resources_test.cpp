// Cores and memory this process may use: cgroup v1 and v2 trees made up in a temporary folder
// (the mount table and the process's cgroup lines as the kernel writes them), and the affinity
// mask of a real thread.
#include "fusebox/core/host_resources.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

namespace fs = std::filesystem;
using fusebox::host::CgroupSources;

namespace {

// A made-up root: /proc/self files and cgroup folders beneath it.
class FakeHost {
 public:
  FakeHost() {
    root_ = fs::temp_directory_path() / ("fusebox-host-test-" + std::to_string(::getpid()) + "-" +
                                         std::to_string(std::random_device{}()));
    fs::create_directories(root_);
  }
  ~FakeHost() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  void write(const std::string& path, const std::string& text) const {
    fs::create_directories((root_ / path.substr(1)).parent_path());
    std::ofstream(root_ / path.substr(1)) << text;
  }
  CgroupSources sources(const std::string& mountinfo, const std::string& cgroup) const {
    write("/proc/self/mountinfo", mountinfo);
    write("/proc/self/cgroup", cgroup);
    CgroupSources s;
    s.mountinfo = (root_ / "proc/self/mountinfo").string();
    s.cgroup = (root_ / "proc/self/cgroup").string();
    s.root = root_.string();
    return s;
  }
  std::string path(const std::string& p) const { return root_.string() + p; }

 private:
  fs::path root_;
};

const char* kV2Mounts =
    "22 1 0:21 / / rw,relatime - ext4 /dev/vda rw\n"
    "30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n";

// Neither a memory limit nor a CPU quota is read from `s`.
void expect_unlimited(const CgroupSources& s, const std::string& what = "") {
  EXPECT_EQ(fusebox::host::cgroup_memory_limit(s).bytes, 0) << what;
  EXPECT_EQ(fusebox::host::cgroup_cpu_quota(s), 0) << what;
}

}  // namespace

TEST(HostResources, CgroupV2TakesTheLowestLimitOfTheCgroupAndItsAncestors) {
  FakeHost h;
  const CgroupSources s = h.sources(kV2Mounts, "0::/user.slice/job.scope\n");
  // No limit on the job itself, 3 GiB on its parent; the root has no memory.max at all.
  h.write("/sys/fs/cgroup/user.slice/job.scope/memory.max", "max\n");
  h.write("/sys/fs/cgroup/user.slice/memory.max", "3221225472\n");
  h.write("/sys/fs/cgroup/user.slice/job.scope/cpu.max", "150000 100000\n");
  h.write("/sys/fs/cgroup/user.slice/cpu.max", "max 100000\n");
  const auto m = fusebox::host::cgroup_memory_limit(s);
  EXPECT_EQ(m.bytes, int64_t{3} << 30);
  EXPECT_EQ(m.cgroup_file, h.path("/sys/fs/cgroup/user.slice/memory.max"));
  EXPECT_DOUBLE_EQ(fusebox::host::cgroup_cpu_quota(s), 1.5);

  // A lower limit further in wins.
  h.write("/sys/fs/cgroup/user.slice/job.scope/memory.max", "1073741824\n");
  h.write("/sys/fs/cgroup/user.slice/cpu.max", "50000 100000\n");
  EXPECT_EQ(fusebox::host::cgroup_memory_limit(s).bytes, int64_t{1} << 30);
  EXPECT_DOUBLE_EQ(fusebox::host::cgroup_cpu_quota(s), 0.5);
}

TEST(HostResources, NoLimitAnywhereIsNoLimit) {
  FakeHost h;
  const CgroupSources s = h.sources(kV2Mounts, "0::/\n");
  EXPECT_EQ(fusebox::host::cgroup_memory_limit(s).bytes, 0);  // the root has no files
  h.write("/sys/fs/cgroup/memory.max", "max\n");
  h.write("/sys/fs/cgroup/cpu.max", "max 100000\n");
  expect_unlimited(s);
  // Garbage and missing sources are no limit either, never an error.
  h.write("/sys/fs/cgroup/memory.max", "lots\n");
  h.write("/sys/fs/cgroup/cpu.max", "100000\n");
  expect_unlimited(s);
  CgroupSources missing;
  missing.mountinfo = h.path("/nothing"), missing.cgroup = h.path("/nothing");
  expect_unlimited(missing);
}

// A container without its own cgroup namespace: the hierarchy's /docker/abc is mounted as the
// container's /sys/fs/cgroup/memory, so the process's path /docker/abc is that mount's top.
TEST(HostResources, CgroupV1ControllersAndAMountOfASubtree) {
  FakeHost h;
  const CgroupSources s = h.sources(
      "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
      "30 22 0:27 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
      "31 30 0:28 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup "
      "rw,cpu,cpuacct\n"
      "34 30 0:31 /docker/abc /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
      "40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
      "12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/docker/abc\n");
  // v1's "no limit" is the largest page-aligned long; a quota of -1 is none.
  h.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  h.write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  h.write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  expect_unlimited(s);

  h.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "536870912\n");
  h.write("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "200000\n");
  const auto m = fusebox::host::cgroup_memory_limit(s);
  EXPECT_EQ(m.bytes, int64_t{512} << 20);
  EXPECT_EQ(m.cgroup_file, h.path("/sys/fs/cgroup/memory/memory.limit_in_bytes"));
  EXPECT_DOUBLE_EQ(fusebox::host::cgroup_cpu_quota(s), 2.0);
}

// Both versions side by side (memory on v1, the unified tree without it), and a mount point
// with a space in it, written as \040 in the mount table.
TEST(HostResources, HybridTreesAndEscapedMountPoints) {
  FakeHost h;
  const CgroupSources s = h.sources(
      "34 30 0:31 / /cg\\040v1/memory rw - cgroup cgroup rw,memory\n"
      "40 30 0:37 / /cg\\040v2 rw - cgroup2 cgroup2 rw\n",
      "4:memory:/batch/7\n0::/batch/7\n");
  h.write("/cg v1/memory/batch/7/memory.limit_in_bytes", "2147483648\n");
  h.write("/cg v1/memory/batch/memory.limit_in_bytes", "4294967296\n");
  h.write("/cg v2/batch/7/cgroup.procs", "");  // the unified tree has no memory files
  const auto m = fusebox::host::cgroup_memory_limit(s);
  EXPECT_EQ(m.bytes, int64_t{2} << 30);
  EXPECT_EQ(m.cgroup_file, h.path("/cg v1/memory/batch/7/memory.limit_in_bytes"));
  // v2's limit, where it is set too, counts as much as v1's.
  h.write("/cg v2/batch/memory.max", "1073741824\n");
  EXPECT_EQ(fusebox::host::cgroup_memory_limit(s).bytes, int64_t{1} << 30);
}

// Several mounts of one hierarchy: the one whose root is the longest prefix of the process's path
// shows its cgroup. A cgroup no mount shows, a path with "..", and odd lines read nothing (the
// mount point would be another cgroup than an ancestor of this one), and never throw.
TEST(HostResources, TheMountShowingTheCgroupIsReadAndNoOther) {
  FakeHost h;
  const std::string mounts =
      "30 22 0:26 /other /mnt/other rw - cgroup2 cgroup2 rw\n"
      "31 22 0:26 / /mnt/all rw - cgroup2 cgroup2 rw\n"
      "32 22 0:26 /job /mnt/job rw - cgroup2 cgroup2 rw\n";
  h.write("/mnt/all/memory.max", "4294967296\n");
  h.write("/mnt/job/memory.max", "2147483648\n");
  h.write("/mnt/job/step/memory.max", "1073741824\n");
  h.write("/mnt/other/memory.max", "1024\n");
  auto m = fusebox::host::cgroup_memory_limit(h.sources(mounts, "0::/job/step\n"));
  EXPECT_EQ(m.bytes, int64_t{1} << 30);  // /mnt/job shows /job/step and /job; not /mnt/other
  EXPECT_EQ(m.cgroup_file, h.path("/mnt/job/step/memory.max"));
  // Only the subtree /other is mounted: the process's /x is in none of them.
  const std::string other_only = "30 22 0:26 /other /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
  h.write("/sys/fs/cgroup/memory.max", "1024\n");
  EXPECT_EQ(fusebox::host::cgroup_memory_limit(h.sources(other_only, "0::/x\n")).bytes, 0);
  for (const char* odd : {"0::/other/../x\n", "0::x\n", "0::\n", "0:\n", "garbage\n"})
    expect_unlimited(h.sources(other_only, odd), odd);
}

// What may still be taken: MemAvailable plus free swap, lowered to the headroom of any cgroup with
// a limit (limit - usage + its page cache), the innermost or an ancestor, v2 or v1.
TEST(HostResources, AvailableMemoryIsTheFreeMemoryOrTheLowestCgroupHeadroom) {
  FakeHost h;
  const std::string meminfo = h.path("/proc/meminfo");
  h.write(
      "/proc/meminfo",
      "MemTotal:       16000000 kB\nMemFree:          100000 kB\n"
      "MemAvailable:    4000000 kB\nSwapTotal:       1000000 kB\nSwapFree:          96000 kB\n");
  CgroupSources s = h.sources(kV2Mounts, "0::/user.slice/job.scope\n");
  EXPECT_EQ(fusebox::host::available_memory(s, meminfo), int64_t{4096000} * 1024);

  // 3 GiB on the parent with 2.5 GiB used, of which 256 MiB is page cache: 768 MiB are left.
  h.write("/sys/fs/cgroup/user.slice/job.scope/memory.max", "max\n");
  h.write("/sys/fs/cgroup/user.slice/memory.max", "3221225472\n");
  h.write("/sys/fs/cgroup/user.slice/memory.current", "2684354560\n");
  h.write("/sys/fs/cgroup/user.slice/memory.stat",
          "anon 2415919104\nfile 268435456\nactive_file 134217728\ninactive_file 134217728\n");
  EXPECT_EQ(fusebox::host::available_memory(s, meminfo), int64_t{768} << 20);
  // A cgroup over its limit has no headroom; the machine's reading is lower still without swap.
  h.write("/sys/fs/cgroup/user.slice/memory.current", "4294967296\n");
  h.write("/sys/fs/cgroup/user.slice/memory.stat", "anon 4294967296\n");
  EXPECT_EQ(fusebox::host::available_memory(s, meminfo), 0);
  h.write("/sys/fs/cgroup/user.slice/memory.max", "max\n");
  h.write("/proc/meminfo", "MemAvailable:        512 kB\n");
  EXPECT_EQ(fusebox::host::available_memory(s, meminfo), 512 * 1024);

  // v1 names the same numbers otherwise.
  const CgroupSources v1 = h.sources(
      "22 1 0:21 / / rw - ext4 /dev/vda rw\n"
      "34 22 0:31 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n",
      "12:memory:/batch\n");
  h.write("/proc/meminfo", "MemAvailable:    4000000 kB\n");
  h.write("/sys/fs/cgroup/memory/batch/memory.limit_in_bytes", "1073741824\n");
  h.write("/sys/fs/cgroup/memory/batch/memory.usage_in_bytes", "1006632960\n");
  h.write("/sys/fs/cgroup/memory/batch/memory.stat",
          "cache 0\ntotal_active_file 33554432\ntotal_inactive_file 0\n");
  EXPECT_EQ(fusebox::host::available_memory(v1, meminfo), int64_t{96} << 20);

  // Nothing to read: unknown.
  CgroupSources missing;
  missing.mountinfo = h.path("/nothing"), missing.cgroup = h.path("/nothing");
  EXPECT_EQ(fusebox::host::available_memory(missing, h.path("/nothing")), -1);
  // This machine has its own reading.
  EXPECT_GT(fusebox::host::available_memory(), 0);
}

TEST(HostResources, UsableMemoryIsAtMostThePhysicalMemory) {
  const auto m = fusebox::host::usable_memory();
  const int64_t physical =
      static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
  EXPECT_GT(m.bytes, 0);
  EXPECT_LE(m.bytes, physical);
  EXPECT_EQ(m.cgroup_file.empty(), m.bytes == physical);
}

// The cores are those of the affinity mask the process starts with (taskset, a cpuset): a copy
// of this test program started on one core counts one. OMP_PROC_BIND makes LibTorch's OpenMP pin
// the main thread to a single core when it loads; that is not a limit on the process, so a copy
// started with it counts every core.
TEST(HostResources, UsableCoresAreTheMaskTheProcessStartsWith) {
  if (const char* expect = std::getenv("FUSEBOX_TEST_EXPECT_CORES")) {  // in the copy
    EXPECT_EQ(fusebox::host::usable_cores(), std::atoi(expect));
    return;
  }
  const int all = fusebox::host::usable_cores();
  EXPECT_GE(all, 1);
  EXPECT_LE(all, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (std::system("command -v taskset >/dev/null") != 0) GTEST_SKIP() << "no taskset";
  cpu_set_t mine;
  ASSERT_EQ(::sched_getaffinity(0, sizeof mine, &mine), 0);
  int first = 0;
  while (!CPU_ISSET(first, &mine)) ++first;
  std::error_code ec;
  const std::string self = fs::read_symlink("/proc/self/exe", ec).string();
  ASSERT_FALSE(ec);
  const auto run_copy = [&](const std::string& env, const std::string& prefix, int expect) {
    const std::string cmd = env + " FUSEBOX_TEST_EXPECT_CORES=" + std::to_string(expect) + " " +
                            prefix + self +
                            " --gtest_filter=HostResources.UsableCoresAreTheMask* 2>&1";
    std::string out;
    if (FILE* p = ::popen(cmd.c_str(), "r")) {
      char buf[4096];
      for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
      EXPECT_EQ(::pclose(p), 0) << cmd << "\n" << out;
    }
    EXPECT_NE(out.find("[  PASSED  ] 1 test."), std::string::npos) << cmd << "\n" << out;
  };
  run_copy("", "taskset -c " + std::to_string(first) + " ", 1);
  run_copy("OMP_PROC_BIND=true", "", all);
  run_copy("OMP_PLACES=cores", "", all);
}
