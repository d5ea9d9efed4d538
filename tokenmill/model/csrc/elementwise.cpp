// Fused elementwise kernels for CPU: RMSNorm (with the residual add), SiLU-and-mul, rotary
// embedding. Each replaces 6-10 separate PyTorch ops (and their intermediate buffers) with one
// pass per row, and rounds to the model dtype at the same points as Hugging Face's eager code,
// so bf16 results stay as close to the reference as the unfused ops were.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace tm_elementwise {  // named: the library compiles as one unit (kernels.py)

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();
constexpr int64_t kPair = 2 * kVec;  // elements handled per step: two float vectors

// Load/store kPair elements as two float vectors; `round` passes values through T's precision.
template <typename T>
struct Pair {
  using tVec = at::vec::Vectorized<T>;
  static inline std::tuple<fVec, fVec> load(const T* p) { return at::vec::convert_to_float<T>(tVec::loadu(p)); }
  static inline void store(T* p, const fVec& a, const fVec& b) { at::vec::convert_from_float<T>(a, b).store(p); }
  static inline std::tuple<fVec, fVec> round(const fVec& a, const fVec& b) {
    return at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
};

template <>
struct Pair<float> {
  static inline std::tuple<fVec, fVec> load(const float* p) { return {fVec::loadu(p), fVec::loadu(p + kVec)}; }
  static inline void store(float* p, const fVec& a, const fVec& b) {
    a.store(p);
    b.store(p + kVec);
  }
  static inline std::tuple<fVec, fVec> round(const fVec& a, const fVec& b) { return {a, b}; }
};

inline float hsum(fVec v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
}

template <typename F>
void dispatch(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t.scalar_type());
  }
}

// x: [T, H] (rows may be strided). residual (optional, same shape, contiguous rows):
// residual = x + residual, then out = weight * norm(residual); else out = weight * norm(x).
void rms_norm(at::Tensor out, at::Tensor x, std::optional<at::Tensor> residual, const at::Tensor& weight,
              double eps) {
  const int64_t rows = x.size(0), H = x.size(1);
  TORCH_CHECK(H % kPair == 0 && x.stride(1) == 1 && out.is_contiguous() && weight.is_contiguous(),
              "rms_norm: unsupported layout");
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    using P = Pair<T>;
    T* o = out.data_ptr<T>();
    T* xp = x.data_ptr<T>();
    T* rp = residual ? residual->data_ptr<T>() : nullptr;
    const T* w = weight.data_ptr<T>();
    const int64_t xs = x.stride(0);
    // from 3 rows (a verification) on both threads: in a forward its rows come from other caches, ~1.5
    // us a row of 1536 on one thread (Zen 4), against ~1 us to fork
    at::parallel_for(0, rows, 2, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xp + r * xs;
        T* src = xr;
        fVec acc(0.f);
        if (rp) {  // residual += x (rounded to T, as an eager add would), and norm the sum
          T* rr = rp + r * H;
          for (int64_t i = 0; i < H; i += kPair) {
            auto [a0, a1] = P::load(xr + i);
            auto [b0, b1] = P::load(rr + i);
            auto [s0, s1] = P::round(a0 + b0, a1 + b1);
            P::store(rr + i, s0, s1);
            acc = at::vec::fmadd(s0, s0, at::vec::fmadd(s1, s1, acc));
          }
          src = rr;
        } else {
          for (int64_t i = 0; i < H; i += kPair) {
            auto [a0, a1] = P::load(xr + i);
            acc = at::vec::fmadd(a0, a0, at::vec::fmadd(a1, a1, acc));
          }
        }
        const fVec inv(1.f / std::sqrt(hsum(acc) / static_cast<float>(H) + static_cast<float>(eps)));
        T* orow = o + r * H;
        for (int64_t i = 0; i < H; i += kPair) {
          auto [a0, a1] = P::load(src + i);
          auto [n0, n1] = P::round(a0 * inv, a1 * inv);
          auto [w0, w1] = P::load(w + i);
          P::store(orow + i, w0 * n0, w1 * n1);
        }
      }
    });
  });
}

// x: [T, 2I] = [gate | up] -> out: [T, I] = silu(gate) * up
constexpr int64_t kSiluPiece = 32 * kPair;  // elements per work item
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  const int64_t rows = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(I % kPair == 0 && x.is_contiguous() && out.is_contiguous(), "silu_and_mul: unsupported layout");
  dispatch(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    using P = Pair<T>;
    const T* xp = x.data_ptr<T>();
    T* o = out.data_ptr<T>();
    const fVec one(1.f);
    // rows in pieces, so that a few rows (a verification) run on both threads too: its exp and
    // division held a 4-row SwiGLU of 8960 on one thread for 27-47 us (16-18 on both; Zen 4)
    const int64_t pieces = (I + kSiluPiece - 1) / kSiluPiece;
    at::parallel_for(0, rows * pieces, 2, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / pieces, i0 = item % pieces * kSiluPiece, i1 = std::min(I, i0 + kSiluPiece);
        const T* g = xp + r * 2 * I;
        const T* u = g + I;
        T* orow = o + r * I;
        for (int64_t i = i0; i < i1; i += kPair) {
          auto [g0, g1] = P::load(g + i);
          auto [s0, s1] = P::round(g0 / (one + g0.neg().exp()), g1 / (one + g1.neg().exp()));
          auto [u0, u1] = P::load(u + i);
          P::store(orow + i, s0 * u0, s1 * u1);
        }
      }
    });
  });
}

// In place, neox layout (rotate halves). q: [T, Hq, D], k: [T, Hk, D] (token rows may be strided,
// heads contiguous); cos, sin: [max_pos, D/2] float; positions: [T] int64.
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions) {
  const int64_t T_ = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(half % kPair == 0 && q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == D && k.stride(1) == D,
              "rotary_embedding: unsupported layout");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && positions.scalar_type() == at::kLong, "rotary_embedding: dtypes");
  dispatch(q, "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    using P = Pair<T>;
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    auto rotate = [&](T* x, const float* c, const float* s) {
      for (int64_t i = 0; i < half; i += kPair) {
        auto [c0, c1] = P::round(fVec::loadu(c + i), fVec::loadu(c + i + kVec));  // HF casts cos/sin to T
        auto [s0, s1] = P::round(fVec::loadu(s + i), fVec::loadu(s + i + kVec));
        auto [a0, a1] = P::load(x + i);
        auto [b0, b1] = P::load(x + half + i);
        auto [ac0, ac1] = P::round(a0 * c0, a1 * c1);
        auto [bs0, bs1] = P::round(b0 * s0, b1 * s1);
        auto [bc0, bc1] = P::round(b0 * c0, b1 * c1);
        auto [as0, as1] = P::round(a0 * s0, a1 * s1);
        P::store(x + i, ac0 - bs0, ac1 - bs1);
        P::store(x + half + i, bc0 + as0, bc1 + as1);
      }
    };
    const int64_t Hq = q.size(1), Hk = k.size(1), qs = q.stride(0), ks = k.stride(0);
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + pos[t] * half;
        const float* s = sp + pos[t] * half;
        for (int64_t h = 0; h < Hq; ++h) rotate(qp + t * qs + h * D, c, s);
        for (int64_t h = 0; h < Hk; ++h) rotate(kp + t * ks + h * D, c, s);
      }
    });
  });
}

}  // namespace tm_elementwise

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor(b!) x, Tensor(c!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor positions) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &tm_elementwise::rms_norm);
  m.impl("silu_and_mul", &tm_elementwise::silu_and_mul);
  m.impl("rotary_embedding", &tm_elementwise::rotary_embedding);
}
