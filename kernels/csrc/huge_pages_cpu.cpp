// Tensors on transparent huge pages (Linux), for the large buffers read at random: the
// paged KV cache (a decode step jumps between 16-token blocks anywhere in it) and the
// packed weights. With 4 KiB pages every few KiB of a cache block is another TLB miss;
// a 2 MiB page covers a whole run of blocks.
//
// empty_huge(shape, dtype): uninitialised, 2 MiB-aligned, madvise(MADV_HUGEPAGE) before
// the first touch (the kernel backs it with huge pages when its THP mode is "always" or
// "madvise"; elsewhere the advice is ignored and the memory is ordinary).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

at::Tensor empty_huge(at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : shape) {
    TORCH_CHECK(s >= 0, "empty_huge: negative size in ", shape);
    numel *= s;
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  const size_t rounded = std::max(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
  void* p = nullptr;
  if (posix_memalign(&p, kHugePage, rounded) != 0) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: failure leaves ordinary pages
#endif
  return at::from_blob(p, shape, [](void* ptr) { std::free(ptr); }, at::TensorOptions().dtype(dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("empty_huge(int[] shape, ScalarType dtype) -> Tensor");
  m.impl("empty_huge", c10::DispatchKey::CompositeExplicitAutograd, &empty_huge);
}
