// A counting CPU allocator (LibTorch's own allocation routine underneath) and CUDA statistics.
#include "fusebox/core/memory_tracker.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <unordered_map>

#include "torch_compat.h"

namespace fusebox::memory {

namespace {

struct Counters {
  std::mutex mu;
  std::unordered_map<void*, size_t> sizes;
  int64_t current = 0, peak = 0;
  std::vector<PhasePeak> phases;  // first-seen order
  size_t active = 0;              // index into phases (valid when phases is not empty)
  // The guard (set_cpu_guard): `limit` is current + free - reserve as of the last reading.
  std::function<int64_t()> available;
  int64_t reserve = 0, limit = 0;
};

Counters& counters() {
  static Counters* c = new Counters();  // never destroyed: tensors may die during exit
  return *c;
}

void count_free(void* ptr) {
  if (!ptr) return;
  Counters& c = counters();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.sizes.find(ptr);
    if (it != c.sizes.end()) {
      c.current -= static_cast<int64_t>(it->second);
      c.sizes.erase(it);
    }
  }
  c10::free_cpu(ptr);
}

// Throws when the guard is set and `nbytes` more would leave less than its reserve free. Called
// with c.mu held.
void check_guard(Counters& c, size_t nbytes) {
  constexpr int64_t kLarge = int64_t{64} << 20;
  if (!c.available) return;
  const int64_t n = static_cast<int64_t>(std::min<size_t>(nbytes, INT64_MAX / 4));
  if (c.current + n <= c.limit && n < kLarge) return;
  const int64_t free_now = c.available();
  if (free_now < 0) {  // unknown: allowed, and not asked again for small requests
    c.limit = INT64_MAX / 2;
    return;
  }
  c.limit = c.current + free_now - c.reserve;
  if (c.current + n <= c.limit) return;
  TORCH_CHECK(false, kGuardRefusal, nbytes, " bytes: ", free_now, " bytes are free (", c.reserve,
              " kept in reserve) and this process's tensors hold ", c.current,
              " bytes; the kernel would end the process when that memory ran out");
}

class CountingAllocator final : public compat::AllocatorBase {
 public:
  c10::DataPtr allocate_bytes(size_t nbytes) const override {
    Counters& c = counters();
    void* ptr = nullptr;
    {
      // One critical section: the guard's check and the count see the same total.
      std::lock_guard<std::mutex> lock(c.mu);
      check_guard(c, nbytes);
      ptr = c10::alloc_cpu(nbytes);
      c.sizes[ptr] = nbytes;
      c.current += static_cast<int64_t>(nbytes);
      if (c.current > c.peak) c.peak = c.current;
      if (!c.phases.empty() && c.current > c.phases[c.active].peak_bytes)
        c.phases[c.active].peak_bytes = c.current;
    }
    return {ptr, ptr, &count_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &count_free; }
};

CountingAllocator* the_allocator() {
  static CountingAllocator* a = new CountingAllocator();  // must outlive every tensor
  return a;
}

bool g_installed = false;

}  // namespace

void install_cpu_tracking() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetCPUAllocator(the_allocator(), /*priority=*/1);
    g_installed = true;
  });
}

bool cpu_tracking_installed() { return g_installed; }

void set_cpu_guard(std::function<int64_t()> available, int64_t reserve) {
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mu);
  c.available = std::move(available);
  c.reserve = std::max<int64_t>(0, reserve);
  c.limit = 0;  // read afresh at the next allocation
}

int64_t current_bytes() {
  std::lock_guard<std::mutex> lock(counters().mu);
  return counters().current;
}

int64_t peak_bytes() {
  std::lock_guard<std::mutex> lock(counters().mu);
  return counters().peak;
}

void reset_peak() {
  {
    std::lock_guard<std::mutex> lock(counters().mu);
    counters().peak = counters().current;
    counters().phases.clear();
  }
  compat::reset_cuda_peak();
}

void mark_phase(const std::string& phase) {
  Counters& c = counters();
  std::lock_guard<std::mutex> lock(c.mu);
  for (size_t i = 0; i < c.phases.size(); ++i)
    if (c.phases[i].phase == phase) {
      c.active = i;
      c.phases[i].peak_bytes = std::max(c.phases[i].peak_bytes, c.current);
      return;
    }
  c.phases.push_back({phase, c.current});
  c.active = c.phases.size() - 1;
}

std::vector<PhasePeak> phase_peaks() {
  std::lock_guard<std::mutex> lock(counters().mu);
  return counters().phases;
}

CudaStats cuda_stats() {
  compat::CudaAllocatorStats s = compat::cuda_allocator_stats();
  return {s.allocated, s.peak_allocated, s.reserved, s.peak_reserved};
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = bytes;
  int u = 0;
  while (std::abs(v) >= 1024.0 && u < 6) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace fusebox::memory
