// fastpar._C: asynchronous all-to-all driven from C++ on any torch.distributed backend.
//
// Binding layer only: argument validation, then ProcessGroup::alltoall_base (gloo on CPUs,
// NCCL on GPUs). The ops follow torch's functional collectives (_c10d_functional's
// all_to_all_single + wait_tensor): all_to_all_start returns the output tensor at once, and
// all_to_all_wait(output) -> output waits for the transfer (rethrowing the backend's error, e.g.
// a peer that died or a timeout) and hands the same tensor back. Because the waited tensor is
// what later code reads, a traced graph keeps the wait and orders every use after it
// (torch.compile traces both ops through their fake implementations, fastpar.moe.overlap).
//
// In-flight transfers are keyed by the output's storage. The tensor handed to the caller is a
// separate storage over the same memory whose deleter drops the registry entry: an output that
// is garbage collected without being waited for releases its entry (the backend still finishes
// the transfer into the buffer it holds; an error it hits is then lost, as with a dropped
// torch.distributed Work). So the registry never holds more entries than there are live,
// unwaited outputs. Waiting a tensor with nothing in flight (waited already, or not made by
// all_to_all_start) returns it at once, as torch's wait_tensor does.
#include <torch/extension.h>
#include <torch/library.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mutex>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fastpar {
namespace {

// Output storage (the caller's) -> the transfer writing into it. Entries leave on wait or when
// that storage is freed (release_output).
std::mutex g_mutex;
std::unordered_map<const c10::StorageImpl*, c10::intrusive_ptr<c10d::Work>> g_works;

// The deleter context of a caller's output: the buffer the backend writes into (the Work holds
// it too) and the registry key of the caller's storage.
struct Output {
  at::Tensor buffer;
  const c10::StorageImpl* key = nullptr;
};

void release_output(void* context) {
  auto* output = static_cast<Output*>(context);
  c10::intrusive_ptr<c10d::Work> dropped;  // destroyed after the lock is released
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_works.find(output->key);
    if (it != g_works.end()) {
      dropped = std::move(it->second);
      g_works.erase(it);
    }
  }
  delete output;  // the backend keeps its own reference to the buffer until it is done
}

std::vector<int64_t> checked_splits(const at::Tensor& t, c10::IntArrayRef splits,
                                    int64_t world, const char* name) {
  std::vector<int64_t> out(splits.begin(), splits.end());
  if (out.empty()) {
    TORCH_CHECK(t.dim() > 0 && t.size(0) % world == 0, "fastpar.all_to_all: ", name,
                " has ", t.dim() > 0 ? t.size(0) : 0, " rows, not divisible by the group size ",
                world, "; pass explicit split sizes");
    return out;
  }
  TORCH_CHECK(static_cast<int64_t>(out.size()) == world, "fastpar.all_to_all: ", name,
              " split sizes have ", out.size(), " entries for a group of ", world,
              " ranks; give one size per rank");
  int64_t total = 0;
  for (int64_t s : out) {
    TORCH_CHECK(s >= 0, "fastpar.all_to_all: negative split size ", s, " in ", name);
    total += s;
  }
  TORCH_CHECK(t.dim() > 0 && total == t.size(0), "fastpar.all_to_all: ", name,
              " split sizes add up to ", total, " but the tensor has ",
              t.dim() > 0 ? t.size(0) : 0, " rows");
  return out;
}

}  // namespace

at::Tensor all_to_all_start(const at::Tensor& input, c10::IntArrayRef output_split_sizes,
                            c10::IntArrayRef input_split_sizes, c10::string_view group_name) {
  TORCH_CHECK(input.dim() > 0, "fastpar.all_to_all: input must have a row dimension");
  auto pg = c10d::resolve_process_group(std::string(group_name));
  const int64_t world = pg->getSize();
  auto in_splits = checked_splits(input, input_split_sizes, world, "input");
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  if (!output_split_sizes.empty()) {
    out_shape[0] = std::accumulate(output_split_sizes.begin(), output_split_sizes.end(),
                                   static_cast<int64_t>(0));
  }
  at::Tensor buffer = at::empty(out_shape, input.options());
  auto out_splits = checked_splits(buffer, output_split_sizes, world, "output");
  at::Tensor in = input.contiguous();  // kept alive by the work until it completes
  auto work = pg->alltoall_base(buffer, in, out_splits, in_splits, c10d::AllToAllOptions());
  // The caller's tensor: its own storage over the buffer's memory, so that dropping it is
  // seen here although the work holds the buffer.
  auto* context = new Output{buffer};
  at::Tensor output = at::from_blob(
      buffer.data_ptr(), buffer.sizes(), buffer.strides(),
      [context](void*) { release_output(context); }, buffer.options());
  context->key = output.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(g_mutex);
  g_works.emplace(context->key, std::move(work));
  return output;
}

at::Tensor all_to_all_wait(const at::Tensor& output) {
  c10::intrusive_ptr<c10d::Work> work;
  if (output.has_storage()) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_works.find(output.storage().unsafeGetStorageImpl());
    if (it != g_works.end()) {
      work = std::move(it->second);
      g_works.erase(it);
    }
  }
  if (work) {
    work->wait();  // the process group's timeout bounds it
  }
  return output;
}

at::Tensor all_to_all(const at::Tensor& input, c10::IntArrayRef output_split_sizes,
                      c10::IntArrayRef input_split_sizes, c10::string_view group_name) {
  return all_to_all_wait(
      all_to_all_start(input, output_split_sizes, input_split_sizes, group_name));
}

int64_t pending_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int64_t>(g_works.size());
}

}  // namespace fastpar

TORCH_LIBRARY(fastpar, m) {
  // Returns the output buffer at once; it is filled once all_to_all_wait(output) returns.
  m.def(
      "all_to_all_start(Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
      "str group_name) -> Tensor");
  // Waits for the transfer into output and returns output (use what it returns: a traced graph
  // orders later reads after the wait through that value).
  m.def("all_to_all_wait(Tensor output) -> Tensor");
  // The same, waited for: a functional op that torch.compile can trace.
  m.def(
      "all_to_all(Tensor input, int[] output_split_sizes, int[] input_split_sizes, "
      "str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastpar, CompositeExplicitAutograd, m) {
  m.impl("all_to_all_start", &fastpar::all_to_all_start);
  m.impl("all_to_all_wait", &fastpar::all_to_all_wait);
  m.impl("all_to_all", &fastpar::all_to_all);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastpar C++ extension: asynchronous all-to-all over torch.distributed backends";
  m.def("pending_count", &fastpar::pending_count,
        "number of started all-to-alls not yet waited for whose output is still alive");
#ifdef FASTPAR_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
