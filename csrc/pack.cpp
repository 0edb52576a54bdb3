// Binding for the chunk pack / unpack ops (validation only; the copies are torch ops on CPU
// and the kernels of pack_kernels.cu on CUDA, launched on the current stream).
#include <torch/extension.h>
#include <torch/library.h>

#ifdef FASTPAR_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
extern "C" cudaError_t fastpar_pack_chunk(const void*, void*, int64_t, int64_t, int64_t,
                                          int64_t, int64_t, cudaStream_t);
extern "C" cudaError_t fastpar_unpack_chunk(const void*, void*, int64_t, int64_t, int64_t,
                                            int64_t, int64_t, cudaStream_t);
#endif

namespace fastpar {
namespace {

void check_chunk(const at::Tensor& full, int64_t c0, int64_t c1) {
  TORCH_CHECK(full.dim() == 3, "fastpar.pack_chunk: expected an [E, C, H] buffer, got ",
              full.sizes());
  TORCH_CHECK(full.is_contiguous(), "fastpar.pack_chunk: the [E, C, H] buffer must be contiguous");
  TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= full.size(1), "fastpar.pack_chunk: rows [", c0, ", ",
              c1, ") are outside the capacity ", full.size(1));
}

// The chunk goes back into rows [c0, c0 + chunk rows) of full: same experts, width, dtype and
// device, contiguous (the CUDA kernel reads it as a flat array).
void check_unpack(const at::Tensor& full, const at::Tensor& chunk, int64_t c0) {
  TORCH_CHECK(chunk.dim() == 3 && full.dim() == 3 && chunk.size(0) == full.size(0) &&
                  chunk.size(2) == full.size(2),
              "fastpar.unpack_chunk: chunk ", chunk.sizes(), " does not fit buffer ", full.sizes());
  TORCH_CHECK(chunk.scalar_type() == full.scalar_type() && chunk.device() == full.device(),
              "fastpar.unpack_chunk: chunk is ", chunk.scalar_type(), " on ", chunk.device(),
              " but the buffer is ", full.scalar_type(), " on ", full.device());
  TORCH_CHECK(chunk.is_contiguous(), "fastpar.unpack_chunk: the chunk must be contiguous");
  check_chunk(full, c0, c0 + chunk.size(1));
}

at::Tensor pack_chunk_cpu(const at::Tensor& full, int64_t c0, int64_t c1) {
  check_chunk(full, c0, c1);
  return full.narrow(1, c0, c1 - c0).contiguous();
}

void unpack_chunk_cpu(at::Tensor full, const at::Tensor& chunk, int64_t c0) {
  check_unpack(full, chunk, c0);
  full.narrow(1, c0, chunk.size(1)).copy_(chunk);
}

#ifdef FASTPAR_WITH_CUDA
at::Tensor pack_chunk_cuda(const at::Tensor& full, int64_t c0, int64_t c1) {
  check_chunk(full, c0, c1);
  const c10::cuda::CUDAGuard guard(full.device());
  auto out = at::empty({full.size(0), c1 - c0, full.size(2)}, full.options());
  auto err = fastpar_pack_chunk(full.data_ptr(), out.data_ptr(), full.size(0), full.size(1), c0,
                                c1, full.size(2) * full.element_size(),
                                c10::cuda::getCurrentCUDAStream(full.device().index()));
  TORCH_CHECK(err == cudaSuccess, "fastpar.pack_chunk: ", cudaGetErrorString(err));
  return out;
}

void unpack_chunk_cuda(at::Tensor full, const at::Tensor& chunk, int64_t c0) {
  check_unpack(full, chunk, c0);
  const c10::cuda::CUDAGuard guard(full.device());
  auto err = fastpar_unpack_chunk(chunk.data_ptr(), full.data_ptr(), full.size(0), full.size(1),
                                  c0, c0 + chunk.size(1), full.size(2) * full.element_size(),
                                  c10::cuda::getCurrentCUDAStream(full.device().index()));
  TORCH_CHECK(err == cudaSuccess, "fastpar.unpack_chunk: ", cudaGetErrorString(err));
}
#endif

}  // namespace
}  // namespace fastpar

TORCH_LIBRARY_FRAGMENT(fastpar, m) {
  m.def("pack_chunk(Tensor full, int c0, int c1) -> Tensor");
  m.def("unpack_chunk(Tensor(a!) full, Tensor chunk, int c0) -> ()");
}

TORCH_LIBRARY_IMPL(fastpar, CPU, m) {
  m.impl("pack_chunk", &fastpar::pack_chunk_cpu);
  m.impl("unpack_chunk", &fastpar::unpack_chunk_cpu);
}

#ifdef FASTPAR_WITH_CUDA
TORCH_LIBRARY_IMPL(fastpar, CUDA, m) {
  m.impl("pack_chunk", &fastpar::pack_chunk_cuda);
  m.impl("unpack_chunk", &fastpar::unpack_chunk_cuda);
}
#endif
