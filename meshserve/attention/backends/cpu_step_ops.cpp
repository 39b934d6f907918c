// A decode step's fused CPU ops (cpu_step_ops.py says what they do and why). Compiled after
// cpu_paged_decode.cpp in one module: its includes and vector helpers serve here too.
#include <cstring>

// Rows of at least this many floats per chunk before at::parallel_for splits them (a prefill's
// thousands of rows; a decode step's few rows stay on the calling thread).
static const int64_t kGrainFloats = 1 << 15;

// s = x + residual (stored to total) and out = s * (1 / sqrt(mean(s * s) + eps)) * w, per row of N;
// without residual (an empty tensor) s = x and total is not written.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  const bool has_res = residual.numel() > 0;
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "float32 x and weight");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.dim() >= 1, "contiguous x and weight");
  const int64_t N = x.size(-1);
  TORCH_CHECK(N > 0 && weight.numel() == N, "weight [N] for x [..., N]");
  TORCH_CHECK(!has_res || (residual.dtype() == torch::kFloat32 && residual.is_contiguous()
                           && residual.sizes() == x.sizes()), "residual: float32, contiguous, shaped as x");
  const int64_t rows = x.numel() / N;
  auto out = torch::empty_like(x);
  auto total = has_res ? torch::empty_like(x) : torch::empty({0}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = has_res ? residual.data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* tp = has_res ? total.data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps), n = static_cast<float>(N);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / N), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * N;
      const float* s = xr;
      if (has_res) {  // the stream first: the norm reads it back from L1
        const float* rr = rp + r * N;
        float* tr = tp + r * N;
        int64_t d = 0;
        for (; d + 16 <= N; d += 16) store16(tr + d, load16(xr + d) + load16(rr + d));
        for (; d < N; ++d) tr[d] = xr[d] + rr[d];
        s = tr;
      }
      v16 acc = {};
      int64_t d = 0;
      for (; d + 16 <= N; d += 16) { v16 v = load16(s + d); acc += v * v; }
      float ss = hsum(acc);
      for (; d < N; ++d) ss += s[d] * s[d];
      const float rstd = 1.f / std::sqrt(ss / n + e);
      float* o = op + r * N;
      for (d = 0; d + 16 <= N; d += 16) store16(o + d, (load16(s + d) * rstd) * load16(w + d));
      for (; d < N; ++d) o[d] = (s[d] * rstd) * w[d];
    }
  });
  return {out, total};
}

// gate_up [..., 2I] (gate, then up) -> silu(gate) * up [..., I]; silu(g) = g * sigmoid(g) with
// e = exp(-|g|): sigmoid = 1 / (1 + e) for g >= 0, e / (1 + e) below (nothing overflows).
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.is_contiguous() && gate_up.dim() >= 1,
              "float32 contiguous gate_up");
  const int64_t W = gate_up.size(-1), I = W / 2;
  TORCH_CHECK(W % 2 == 0, "gate_up: an even last dimension (gate, then up)");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const int64_t rows = I > 0 ? gate_up.numel() / W : 0;
  const float* gu = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(W, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gu + r * W;
      const float* u = g + I;
      float* o = op + r * I;
      int64_t d = 0;
      for (; d + 16 <= I; d += 16) {
        const v16 x = load16(g + d);
        const v16 neg_abs = x < 0.f ? x : -x;
        const v16 ex = exp16(neg_abs);
        const v16 sig = (x >= 0.f ? (v16){} + 1.f : ex) / (1.f + ex);
        store16(o + d, (x * sig) * load16(u + d));
      }
      for (; d < I; ++d) {
        const float x = g[d], ex = std::exp(-std::fabs(x));
        o[d] = (x * ((x >= 0.f ? 1.f : ex) / (1.f + ex))) * u[d];
      }
    }
  });
  return out;
}

// The rotation of one head's two halves, a1 = x1 * c1 - x2 * s1 and a2 = x2 * c2 + x1 * s2, with
// each product rounded before the sum (no fused multiply-add): what apply_rotary's
// x * cos + rotate_half(x) * sin computes in float32, bit for bit.
#if defined(__clang__)
static void rotate_head(const float* x, const float* c, const float* s, int64_t half, float* y) {
#pragma clang fp contract(off)
#elif defined(__GNUC__)
__attribute__((optimize("fp-contract=off")))
static void rotate_head(const float* x, const float* c, const float* s, int64_t half, float* y) {
#else
static void rotate_head(const float* x, const float* c, const float* s, int64_t half, float* y) {
#endif
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = x[d], x2 = x[half + d];
    y[d] = x1 * c[d] - x2 * s[d];
    y[half + d] = x2 * c[half + d] + x1 * s[half + d];
  }
}

// qkv [T, (H + 2 Hkv) * D] (q heads, k heads, v heads); cos, sin [T, D] or [T, 1, D] float32 (full
// width); cache [N, 2, bs, Hkv, D] float32; slots [T] int64 (-1: not stored on this rank).
// Returns q [T, H, D] and k [T, Hkv, D] rotated (new tensors) and v [T, Hkv, D] (a view of qkv);
// k and v stored at each kept slot.
std::vector<torch::Tensor> rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                           torch::Tensor cache, torch::Tensor slots, int64_t H, int64_t Hkv) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32
              && cache.dtype() == torch::kFloat32, "float32 qkv, cos, sin and cache");
  TORCH_CHECK(slots.dtype() == torch::kInt64, "int64 slots");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && cache.is_contiguous()
              && slots.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(qkv.dim() == 2 && cache.dim() == 5 && H > 0 && Hkv > 0,
              "qkv [T, (H + 2 Hkv) * D], cache [N, 2, bs, Hkv, D]");
  const int64_t T = qkv.size(0), D = cache.size(4), bs = cache.size(2), N = cache.size(0);
  TORCH_CHECK(cache.size(1) == 2 && cache.size(3) == Hkv && D % 2 == 0, "cache [N, 2, bs, Hkv, D], D even");
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D, "qkv width (H + 2 Hkv) * D");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D && slots.numel() == T, "cos, sin [T, D]; slots [T]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // checked before anything is written: no store outside the cache
    TORCH_CHECK(sl[t] >= -1 && sl[t] < N * bs, "slot_mapping[", t, "]=", sl[t], " outside the cache");
  auto q = torch::empty({T, H, D}, qkv.options());
  auto k = torch::empty({T, Hkv, D}, qkv.options());
  const int64_t W = qkv.size(1), half = D / 2, row = Hkv * D;
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* kv = cache.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, kGrainFloats / W), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = src + t * W;
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t h = 0; h < H; ++h) rotate_head(x + h * D, c, s, half, qp + (t * H + h) * D);
      float* kt = kp + t * row;
      for (int64_t h = 0; h < Hkv; ++h) rotate_head(x + (H + h) * D, c, s, half, kt + h * D);
      if (sl[t] < 0) continue;
      const int64_t block = sl[t] / bs, off = sl[t] % bs;
      float* k_dst = kv + ((block * 2) * bs + off) * row;
      float* v_dst = kv + ((block * 2 + 1) * bs + off) * row;
      std::memcpy(k_dst, kt, row * sizeof(float));
      std::memcpy(v_dst, x + (H + Hkv) * D, row * sizeof(float));
    }
  });
  return {q, k, qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D})};
}

// x [N, V] -> [N] int64: per row the index of the first maximum, a NaN counting as the largest
// (the first NaN): torch's max(dim).indices. Each of 16 lanes keeps its first maximum (a strict >
// never moves off an earlier equal value); across lanes the largest value, then the lowest index.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.size(1) > 0,
              "x: float32, contiguous, [N, V] with V >= 1");
  const int64_t N = x.size(0), V = x.size(1);
  auto out = torch::empty({N}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, kGrainFloats / V), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      int64_t best = 0;
      int64_t v0 = 0;
      if (V >= 16) {
        v16 bv = load16(row);
        i16 bi = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        i16 nan = bv != bv;
        const i16 step = (i16){} + 16;
        i16 idx = bi;
        for (v0 = 16; v0 + 16 <= V; v0 += 16) {
          const v16 v = load16(row + v0);
          idx += step;
          const i16 gt = v > bv;
          bv = gt ? v : bv;
          bi = gt ? idx : bi;
          nan |= v != v;
        }
        bool any_nan = false;
        for (int j = 0; j < 16; ++j) any_nan |= nan[j] != 0;
        if (any_nan) {  // the first NaN wins (rare: a scalar scan)
          int64_t i = 0;
          while (!std::isnan(row[i])) ++i;
          op[r] = i;
          continue;
        }
        float m = bv[0];
        best = bi[0];
        for (int j = 1; j < 16; ++j)
          if (bv[j] > m || (bv[j] == m && bi[j] < best)) { m = bv[j]; best = bi[j]; }
      }
      for (int64_t i = v0; i < V; ++i) {  // the tail (the whole row when V < 16), in order
        if (std::isnan(row[i])) {
          if (!std::isnan(row[best])) best = i;
          break;
        }
        if (i == 0 || row[i] > row[best]) best = i;
      }
      op[r] = best;
    }
  });
  return out;
}
