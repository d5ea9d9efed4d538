// Paged attention for CPU decodes: each query token attends to its sequence's K/V read in place
// from the block-paged cache (no gather copy). Built at first use by tokenmill/model/kernels.py;
// the caller is attention/cpu_paged.py.
//
// Cache layout (per layer, reinterpreting the runner's [num_blocks, block_size, Hkv, D] buffers):
//   K: [num_blocks, Hkv, D, block_size]  (transposed: one row of block_size keys per dimension)
//   V: [num_blocks, Hkv, block_size, D]  (head-major rows)
// With K transposed, q.k for a whole block is block_size-wide FMAs over D (no horizontal sums);
// one task per (sequence, kv head) on torch's intra-op threads, the G query heads of a kv head
// sharing every K/V load. Scores, then a vectorized exp, then the weighted sum of V.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// kVec consecutive elements as floats
template <typename T>
inline fVec load_vec(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return fVec::loadu(p);
  } else {
    alignas(64) float tmp[kVec];
    for (int64_t i = 0; i < kVec; ++i) tmp[i] = to_float(p[i]);
    return fVec::loadu(tmp);
  }
}

#if defined(__AVX512F__)
#include <immintrin.h>
template <>
inline fVec load_vec<at::BFloat16>(const at::BFloat16* p) {  // bf16 -> f32 is a 16-bit shift
  return fVec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16)));
}
#endif

constexpr int64_t kMaxG = 16;  // query heads per kv head handled by the vector path

template <typename T>
void decode_attention(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                      int64_t max_blocks, float scale) {
  const int64_t G = H / Hkv;
  const int64_t block_elems = Hkv * D * BS;  // one block of one layer's K (or V)
  const bool vector_path = BS % kVec == 0 && D % kVec == 0 && G <= kMaxG;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), inv(G), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = seq_lens[b], nblocks = (L + BS - 1) / BS, Lp = nblocks * BS;
      const int64_t* table = block_tables + b * max_blocks;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(q[(b * H + h * G) * D + i]) * scale;
      scores.resize(G * Lp);
      // scores[g, t] = q_g . k_t, a block of BS keys at a time
      for (int64_t j = 0; j < nblocks; ++j) {
        const T* kt = k_cache + table[j] * block_elems + h * D * BS;  // [D, BS]
        if (vector_path) {
          for (int64_t c = 0; c < BS; c += kVec) {
            fVec s[kMaxG];
            for (int64_t g = 0; g < G; ++g) s[g] = fVec(0.f);
            for (int64_t d = 0; d < D; ++d) {
              const fVec krow = load_vec(kt + d * BS + c);
              for (int64_t g = 0; g < G; ++g) s[g] = at::vec::fmadd(fVec(qf[g * D + d]), krow, s[g]);
            }
            for (int64_t g = 0; g < G; ++g) s[g].store(scores.data() + g * Lp + j * BS + c);
          }
        } else {
          for (int64_t g = 0; g < G; ++g)
            for (int64_t o = 0; o < BS; ++o) {
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * to_float(kt[d * BS + o]);
              scores[g * Lp + j * BS + o] = s;
            }
        }
      }
      // softmax numerators over the first L scores of each head
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * Lp;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
        fVec vsum(0.f);
        int64_t t = 0;
        for (; t + kVec <= L; t += kVec) {
          fVec e = (fVec::loadu(sg + t) - fVec(m)).exp_u20();
          e.store(sg + t);
          vsum = vsum + e;
        }
        float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& c) { return a + c; }, vsum);
        for (; t < L; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        inv[g] = 1.f / sum;
      }
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* v = v_cache + table[t / BS] * block_elems + (h * BS + t % BS) * D;
        if (D % kVec == 0) {
          for (int64_t d = 0; d < D; d += kVec) {
            const fVec vv = load_vec(v + d);
            for (int64_t g = 0; g < G; ++g) {
              float* ag = acc.data() + g * D + d;
              at::vec::fmadd(fVec(scores[g * Lp + t]), vv, fVec::loadu(ag)).store(ag);
            }
          }
        } else {
          for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] += scores[g * Lp + t] * to_float(v[d]);
        }
      }
      T* o = out + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<T>(acc[g * D + d] * inv[g]);
    }
  });
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

// out, q: [B, H, D] contiguous; k_cache: [num_blocks, Hkv, D, BS]; v_cache: [num_blocks, Hkv, BS, D];
// block_tables: [B, max_blocks] int64; seq_lens: [B] int64
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block tables and lengths must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), BS = k_cache.size(3);
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  dispatch(q, "paged_decode_attention", [&](auto tag) {
    using T = decltype(tag);
    decode_attention<T>(out.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, D, BS, bt.size(1),
                        static_cast<float>(scale));
  });
}

// Write new tokens' K (transposed) and V into their cache slots. k, v: [T, Hkv, D] (token rows may
// be strided, heads contiguous); slots: [T] int64 (block * BS + offset).
void write_kv_cache(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slots) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "write_kv_cache: heads must be contiguous");
  const int64_t T_ = k.size(0), Hkv = k.size(1), D = k.size(2), BS = k_cache.size(3);
  const int64_t* sp = slots.data_ptr<int64_t>();
  dispatch(k, "write_kv_cache", [&](auto tag) {
    using T = decltype(tag);
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    const T* kp = k.data_ptr<T>();
    const T* vp = v.data_ptr<T>();
    const int64_t ks = k.stride(0), vs = v.stride(0);
    at::parallel_for(0, T_, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t blk = sp[t] / BS, off = sp[t] % BS;
        for (int64_t h = 0; h < Hkv; ++h) {
          T* kdst = kc + ((blk * Hkv + h) * D) * BS + off;
          T* vdst = vc + ((blk * Hkv + h) * BS + off) * D;
          const T* ksrc = kp + t * ks + h * D;
          const T* vsrc = vp + t * vs + h * D;
          for (int64_t d = 0; d < D; ++d) kdst[d * BS] = ksrc[d];
          std::copy(vsrc, vsrc + D, vdst);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> ()");
  m.def("write_kv_cache(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
