// The paged decode kernel of CPU_SDPA (cpu_paged_decode.py says what it does and why).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// GCC/Clang vector types: one AVX-512 register (two AVX2 ones where that is what -march gives).
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
static inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, 64); }

static inline float hsum(v16 a) {
  v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7)
       + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) acc += load16(a + d) * load16(b + d);
  float s = hsum(acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

static inline void axpy(float* y, const float* x, float a, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) store16(y + d, load16(y + d) + a * load16(x + d));
  for (; d < n; ++d) y[d] += a * x[d];
}

// exp(x) of 16 values <= 0: Cody-Waite range reduction and a degree-6 polynomial (within 2 ulp of
// expf on [-87, 0]; 0 below). std::exp is one scalar call per element: a third of the kernel.
static inline v16 exp16(v16 x) {
  const v16 floor = (v16){} - 87.f;
  v16 v = x < floor ? floor : x;
  v16 k = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  v16 r = v - k * 0.693359375f + k * 2.12194440e-4f;
  v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  i16 bits = (__builtin_convertvector(k, i16) + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, 64);
  v16 e = p * scale;
  i16 under = x < -87.f;
  __builtin_memcpy(&bits, &e, 64);
  bits &= ~under;
  __builtin_memcpy(&e, &bits, 64);
  return e;
}

// x[i] = exp(x[i] - m) for i < n; returns their sum.
static inline float exp_shift(float* x, int64_t n, float m) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 e = exp16(load16(x + i) - m);
    store16(x + i, e);
    acc += e;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) { x[i] = std::exp(x[i] - m); sum += x[i]; }
  return sum;
}

// Softmax of each head's L scores in place (head h's row at p + h * stride); a sink joins the
// denominator only. ls[h]: the row's log-sum-exp; inv[h]: 1 / its sum (the values' scale).
static void softmax_heads(float* p, int64_t stride, int64_t L, int64_t H, const float* sk, float* ls, float* inv) {
  for (int64_t h = 0; h < H; ++h) {
    float* ph = p + h * stride;
    float m = ph[0];
    for (int64_t l = 1; l < L; ++l) m = std::max(m, ph[l]);
    if (sk) m = std::max(m, sk[h]);
    float sum = exp_shift(ph, L, m);
    if (sk) sum += std::exp(sk[h] - m);
    ls[h] = m + std::log(sum);
    inv[h] = 1.f / sum;
  }
}


// The 16 lane-sums of 16 vectors, as one vector (out[j] = sum of x[j]'s lanes): a transposing
// tree of shuffles and adds, 45 operations for 16 sums where one hsum each costs about 7.
static inline v16 sum16(const v16* x) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                   23)
         + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                   30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
         + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
         + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  v16 d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
        + __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // d holds the sums in bit-reversed token order (0, 8, 4, 12, ...); bit reversal is its own inverse
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// Pass 1 of one sequence for head dims of ND x 16: the scores of every query head against 16 keys
// at a time, p[h * Lp + l] (Lp: L rounded up to 16). The query head's vectors stay in registers
// while 16 K rows stream past; one sum16 per head and 16 keys.
template <int ND>
static void scores_fast(const float* qs, const float* kv, const int32_t* blocks, int64_t L, int64_t Lp,
                        int64_t bs, int64_t Hkv, int64_t G, int64_t half, float cap, float* p,
                        const float* next_k0) {
  constexpr int64_t D = ND * 16;
  const int64_t row = Hkv * D;
  const float* rows[16];
  for (int64_t l0 = 0; l0 < L; l0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - l0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t l = l0 + j;
      rows[j] = kv + static_cast<int64_t>(blocks[l / bs]) * 2 * half + (l % bs) * row;
      // this key's V row (read in pass 2) and the K row 16 keys on (the next sequence's first
      // rows after the last), into L2 (locality 2): blocks lie anywhere, so the hardware
      // prefetcher cannot run ahead. Into L2 rather than L1 (locality 3, what the per-key path
      // uses) the kernel ran 537-571 against 819-905 us at 64 sequences with cold caches
      // (bench/cpu_kernels.py's shape); 32 keys ahead was level, 64 slower.
      const int64_t la = l + 16;
      const float* ahead = la < L ? kv + static_cast<int64_t>(blocks[la / bs]) * 2 * half + (la % bs) * row
                                  : (next_k0 && la - L < bs ? next_k0 + (la - L) * row : nullptr);
      for (int64_t c = 0; c < row; c += 16) {
        __builtin_prefetch(rows[j] + half + c, 0, 2);
        if (ahead) __builtin_prefetch(ahead + c, 0, 2);
      }
    }
    for (int64_t kh = 0; kh < Hkv; ++kh)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        v16 qv[ND];
        for (int c = 0; c < ND; ++c) qv[c] = load16(qs + h * D + c * 16);
        v16 part[16];
        for (int64_t j = 0; j < 16; ++j) {
          if (j < n) {
            const float* k = rows[j] + kh * D;
            v16 acc = qv[0] * load16(k);
            for (int c = 1; c < ND; ++c) acc += qv[c] * load16(k + c * 16);
            part[j] = acc;
          } else {
            part[j] = (v16){};
          }
        }
        v16 sc = sum16(part);
        if (cap > 0.f)
          for (int j = 0; j < 16; ++j) sc[j] = cap * std::tanh(sc[j] / cap);
        store16(p + h * Lp + l0, sc);
      }
  }
}

// Pass 2 of one sequence: out[h] = sum over keys of p[h][l] * V[l], GB query heads at a time with
// their ND x 16 outputs in registers (no load and store of the output per key), keys in order.
template <int ND, int GB>
static void values_fast(const float* kv, const int32_t* blocks, int64_t L, int64_t Lp, int64_t bs,
                        int64_t Hkv, int64_t G, int64_t half, const float* p, const float* inv, float* os,
                        const float* next_k0, int64_t next_n) {
  constexpr int64_t D = ND * 16;
  const int64_t row = Hkv * D;
  for (int64_t kh = 0; kh < Hkv; ++kh)
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      const int64_t h0 = kh * G + g0;
      v16 acc[GB][ND] = {};
      for (int64_t l = 0; l < L; ++l) {
        const float* v = kv + (static_cast<int64_t>(blocks[l / bs]) * 2 + 1) * half + (l % bs) * row + kh * D;
        if (kh == 0 && g0 == 0 && l < next_n)  // the next sequence's K rows, for its pass 1
          for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(next_k0 + l * row + c);
        v16 vv[ND];
        for (int c = 0; c < ND; ++c) vv[c] = load16(v + c * 16);
        for (int b = 0; b < GB; ++b) {
          const float w = p[(h0 + b) * Lp + l];
          for (int c = 0; c < ND; ++c) acc[b][c] += w * vv[c];
        }
      }
      for (int b = 0; b < GB; ++b)
        for (int c = 0; c < ND; ++c) store16(os + (h0 + b) * D + c * 16, acc[b][c] * inv[h0 + b]);
    }
}

template <int ND>
static void sequence_fast(const float* qs, const float* kv, const int32_t* blocks, int64_t L, int64_t bs,
                          int64_t Hkv, int64_t G, int64_t half, float cap, const float* sk, float* ls,
                          float* os, std::vector<float>& p, const float* next_k0, int64_t next_L) {
  const int64_t H = Hkv * G, Lp = (L + 15) / 16 * 16;
  p.resize(H * Lp);
  scores_fast<ND>(qs, kv, blocks, L, Lp, bs, Hkv, G, half, cap, p.data(), next_k0);
  thread_local std::vector<float> inv;  // one per head (no bound on the heads a rank holds)
  inv.resize(H);
  softmax_heads(p.data(), Lp, L, H, sk, ls, inv.data());
  const int64_t next_n = next_k0 ? std::min(bs, next_L) : 0;
  if (G % 2 == 0)
    values_fast<ND, 2>(kv, blocks, L, Lp, bs, Hkv, G, half, p.data(), inv.data(), os, next_k0, next_n);
  else
    values_fast<ND, 1>(kv, blocks, L, Lp, bs, Hkv, G, half, p.data(), inv.data(), os, next_k0, next_n);
}

// query [S, H, D] f32; cache [N, 2, bs, Hkv, D] f32; table [S, W] int32; kv_lens [S] int32;
// sinks [H] f32 or empty; soft_cap <= 0: none. Returns out [S, H, D] f32, lse [S, H] f32.
std::vector<torch::Tensor> paged_decode(torch::Tensor query, torch::Tensor cache, torch::Tensor table,
                                        torch::Tensor kv_lens, double scale, double soft_cap,
                                        torch::Tensor sinks) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && cache.dtype() == torch::kFloat32, "float32 query and cache");
  TORCH_CHECK(table.dtype() == torch::kInt32 && kv_lens.dtype() == torch::kInt32, "int32 table and kv_lens");
  TORCH_CHECK(query.is_contiguous() && cache.is_contiguous() && table.is_contiguous() && kv_lens.is_contiguous(),
              "contiguous inputs");
  TORCH_CHECK(query.dim() == 3 && cache.dim() == 5 && table.dim() == 2, "query [S, H, D], cache [N, 2, bs, Hkv, D]");
  const int64_t S = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = cache.size(2), Hkv = cache.size(3), W = table.size(1), N = cache.size(0);
  TORCH_CHECK(cache.size(4) == D && H % Hkv == 0 && table.size(0) == S && kv_lens.size(0) == S, "shapes");
  const bool has_sinks = sinks.numel() > 0;
  TORCH_CHECK(!has_sinks || (sinks.dtype() == torch::kFloat32 && sinks.numel() == H), "sinks [H] float32");
  const int64_t G = H / Hkv;
  auto out = torch::zeros({S, H, D}, query.options());
  auto lse = torch::empty({S, H}, query.options());
  const float* q = query.data_ptr<float>();
  const float* kv = cache.data_ptr<float>();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const float* sk = has_sinks ? sinks.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  float* ls = lse.data_ptr<float>();
  const float cap = static_cast<float>(soft_cap), sc = static_cast<float>(scale);
  const int64_t row = Hkv * D, half = bs * row;  // one token's K (or V) rows; K to V of a block
  for (int64_t s = 0; s < S; ++s) {  // checked before any thread starts: no read outside the cache
    const int64_t L = lens[s];
    TORCH_CHECK(L >= 0 && (L + bs - 1) / bs <= W, "kv_lens[", s, "]=", L, " outside the block table");
    for (int64_t b = 0; b < (L + bs - 1) / bs; ++b)
      TORCH_CHECK(tab[s * W + b] >= 0 && tab[s * W + b] < N, "block id out of range");
  }
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> qs(H * D), p;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t L = lens[s];
      float* os = o + s * H * D;
      if (L == 0) {
        for (int64_t h = 0; h < H; ++h) ls[s * H + h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      for (int64_t i = 0; i < H * D; ++i) qs[i] = q[s * H * D + i] * sc;
      if ((D == 64 || D == 128) && H <= 64) {
        const int64_t next_L = s + 1 < s1 ? lens[s + 1] : 0;
        const float* next_k0 = next_L > 0 ? kv + static_cast<int64_t>(tab[(s + 1) * W]) * 2 * half : nullptr;
        const int32_t* blocks = tab + s * W;
        if (D == 64)
          sequence_fast<4>(qs.data(), kv, blocks, L, bs, Hkv, G, half, cap, sk, ls + s * H, os, p, next_k0, next_L);
        else
          sequence_fast<8>(qs.data(), kv, blocks, L, bs, Hkv, G, half, cap, sk, ls + s * H, os, p, next_k0, next_L);
        continue;
      }
      p.resize(H * L);
      const int32_t* blocks = tab + s * W;
      for (int64_t l0 = 0; l0 < L; l0 += bs) {  // pass 1: K, every query head's score
        const float* k = kv + static_cast<int64_t>(blocks[l0 / bs]) * 2 * half;
        const int64_t n = std::min(bs, L - l0);
        // Blocks lie anywhere in the cache, so the hardware prefetcher cannot run ahead of this
        // loop: ask for the next K block (the next sequence's first one after the last) and this
        // block's V (read in pass 2) while this block is scored. Without it the kernel waited on
        // memory: 1.56 against 0.84 ms for the torch ops at 64 x 128 keys with cold caches (with it, 0.47-0.50;
        // with the next sequence's K asked for in pass 2 too, 0.36-0.40).
        const int64_t next = l0 + bs < L ? blocks[l0 / bs + 1]
                             : (s + 1 < s1 && lens[s + 1] > 0 ? tab[(s + 1) * W] : -1);
        const float* v_here = k + half;
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t c = 0; c < row; c += 16) {
            if (next >= 0) __builtin_prefetch(kv + next * 2 * half + t * row + c);
            __builtin_prefetch(v_here + t * row + c);
          }
          for (int64_t kh = 0; kh < Hkv; ++kh)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t h = kh * G + g;
              float x = dot(qs.data() + h * D, k + t * row + kh * D, D);
              if (cap > 0.f) x = cap * std::tanh(x / cap);
              p[h * L + l0 + t] = x;
            }
        }
      }
      std::vector<float> inv(H);
      softmax_heads(p.data(), L, L, H, has_sinks ? sk : nullptr, ls + s * H, inv.data());
      for (int64_t l0 = 0; l0 < L; l0 += bs) {  // pass 2: V, added into every query head's output
        const float* v = kv + (static_cast<int64_t>(blocks[l0 / bs]) * 2 + 1) * half;
        const int64_t n = std::min(bs, L - l0);
        // V is in cache by now (prefetched in pass 1): meanwhile ask for the next sequence's K
        // rows at the same positions, so that its pass 1 starts on cached rows.
        const bool ahead = s + 1 < s1 && l0 < lens[s + 1];
        const float* k_next = ahead ? kv + static_cast<int64_t>(tab[(s + 1) * W + l0 / bs]) * 2 * half : nullptr;
        const int64_t n_next = ahead ? std::min<int64_t>(bs, lens[s + 1] - l0) : 0;
        for (int64_t t = 0; t < n; ++t) {
          if (t < n_next)
            for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(k_next + t * row + c);
          for (int64_t kh = 0; kh < Hkv; ++kh)
            for (int64_t g = 0; g < G; ++g) {
              const int64_t h = kh * G + g;
              axpy(os + h * D, v + t * row + kh * D, p[h * L + l0 + t], D);
            }
        }
      }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) os[h * D + d] *= inv[h];
    }
  });
  return {out, lse};
}
