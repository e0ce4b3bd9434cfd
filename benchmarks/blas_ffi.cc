// A float32 product as an XLA FFI custom call over a CBLAS sgemm, for
// benchmarks/bench_blas_ffi.py (which compiles this file; sexpgpu does not ship it).
//
// C[M, N] = op(A) op(B), row-major; `ta` says A is stored [K, M], `tb` that B is [N, K],
// so the gradients G·Wᵀ and Aᵀ·G need no transposed copy. The sgemm is looked up once by
// sx_blas_init (a 64-bit-integer CBLAS, as NumPy's bundled OpenBLAS is).
#include <dlfcn.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using Sgemm = void (*)(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                       float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                       float beta, float* c, int64_t ldc);

static Sgemm sgemm = nullptr;

extern "C" int sx_blas_init(const char* library, const char* symbol) {
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return 1;
  sgemm = reinterpret_cast<Sgemm>(dlsym(handle, symbol));
  return sgemm == nullptr ? 2 : 0;
}

static ffi::Error Gemm(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::ResultBuffer<ffi::F32> c, bool ta, bool tb) {
  if (sgemm == nullptr) return ffi::Error::InvalidArgument("sx_blas_init was not called");
  auto da = a.dimensions();
  auto db = b.dimensions();
  if (da.size() != 2 || db.size() != 2) return ffi::Error::InvalidArgument("2-D operands only");
  const int64_t m = ta ? da[1] : da[0], k = ta ? da[0] : da[1], n = tb ? db[0] : db[1];
  constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
  sgemm(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, m, n, k, 1.0f,
        a.typed_data(), da[1], b.typed_data(), db[1], 0.0f, c->typed_data(), n);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SxBlasGemm, Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("ta")
                                  .Attr<bool>("tb"));
