// A decoding step's attention over 8-, 6- or 4-bit coded slots, or float8 ones, on a CPU, reading the codes as they
// are (cpu_kernels.py builds it; decode_kernel.decode_attention calls it). The same math as decoding every row
// (codec.IntCodec) and attending: per group of channels, q.k = scale * q.codes + minimum * sum(q) and
// sum_j p_j v_j = sum_j (p_j scale_j) codes_j + sum_j p_j minimum_j, so nothing decoded is written to memory
// (float8 rows: each byte's value from a table, a scale of 1 and no minimum).
// Work is split along the slots (flash-decoding) into enough slices to keep the threads busy: each task keeps an
// online softmax over its slice, read in blocks, and the slices are weighed by their maxima and sums at the end.
// A row: codes (4 bits: channel 2i in byte i's low nibble, 2i + 1 in its high one; 6 bits: those nibbles for the
// codes' low 4 bits, then per group of channels its top 2 bits, a quarter of the group a byte, in the order a
// group unpacks: its even channels, then its odd ones, place m + j * group / 4 at bits 2j and 2j + 1 of byte m),
// then every group's float16 scale, then every group's float16 minimum (float8: a byte a channel, nothing after).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t kBlockSlots = 128;      // slots a task reads at a time (and the shortest slice a task takes)
constexpr int64_t kTasksPerThread = 8;     // slices enough for this many tasks per thread, no more
constexpr int64_t kSlotsPerThread = 2048;  // fewer slots (over every head) than this run on one thread
constexpr float kNone = -std::numeric_limits<float>::infinity();
constexpr int kFp8 = -8;  // rows of float8 e4m3 with a scale of 1 (vLLM's fp8), not integer codes

// Every float8 e4m3 byte's value, built once.
const float* fp8_values() {
  static const std::vector<float> table = [] {
    std::vector<float> values(256);
    for (int i = 0; i < 256; ++i)
      values[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return values;
  }();
  return table.data();
}

// Code bytes of a row (float8: one a channel, and no scales after them).
constexpr int64_t code_bytes(int bits, int64_t dim) { return bits == kFp8 ? dim : dim * bits / 8; }

inline float half_at(const uint8_t* bytes) {
  const uint16_t bits = static_cast<uint16_t>(bytes[0]) | static_cast<uint16_t>(bytes[1]) << 8;
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// A row's codes as floats; 4 and 6 bits: each group's even channels, then its odd ones (queries are laid out alike).
template <int BITS>
inline __attribute__((always_inline)) void unpack(float* out, const uint8_t* codes, int64_t dim, int64_t group) {
  if (BITS == 8) {
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) out[c] = static_cast<float>(codes[c]);
    return;
  }
  if (BITS == kFp8) {
    const float* values = fp8_values();
    for (int64_t c = 0; c < dim; ++c) out[c] = values[codes[c]];
    return;
  }
  const int64_t half = group / 2, quarter = group / 4;
  for (int64_t start = 0; start < dim; start += group) {
    const uint8_t* bytes = codes + start / 2;
    if (BITS == 4) {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        out[start + i] = static_cast<float>(bytes[i] & 15);
        out[start + half + i] = static_cast<float>(bytes[i] >> 4);
      }
      continue;
    }
    // 6 bits: the nibbles plus 16 times the top bits, top byte m holding those of places m + j * quarter
    const uint8_t* tops = codes + dim / 2 + start / 4;
#pragma omp simd
    for (int64_t i = 0; i < quarter; ++i) {
      out[start + i] = static_cast<float>((bytes[i] & 15) | (tops[i] & 3) << 4);
      out[start + half + i] = static_cast<float>((bytes[i] >> 4) | (tops[i] & 48));
    }
#pragma omp simd
    for (int64_t i = quarter; i < half; ++i) {
      out[start + i] = static_cast<float>((bytes[i] & 15) | (tops[i - quarter] & 12) << 2);
      out[start + half + i] = static_cast<float>((bytes[i] >> 4) | (tops[i - quarter] & 192) >> 2);
    }
  }
}

inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

// Channel c of a group as unpack<BITS> places it.
inline int64_t unpacked_at(int bits, int64_t c, int64_t group) {
  return bits == 4 || bits == 6 ? (c % 2 ? group / 2 + c / 2 : c / 2) : c;
}

struct Shape {
  int64_t heads, rows, slots, dim, group, key_row, value_row, visible_heads;
  float scaling;
};

// One slice of one (row of the batch, KV head), read in blocks of kBlockSlots (a block's codes and weights stay in
// the core's cache) under an online softmax: its maximum and sum per query row, and its unnormalised output (in the
// model's channel order).
template <int KB, int VB, int64_t G>
void slice(const Shape& s, const float* query, const uint8_t* keys, const uint8_t* values, const bool* seen,
           int64_t first, int64_t last, float* peak, float* total, float* out) {
  const int64_t group = G > 0 ? G : s.group, groups = s.dim / group, rows = s.rows, dim = s.dim;
  const int64_t key_codes = code_bytes(KB, dim), value_codes = code_bytes(VB, dim);
  std::vector<float> q(rows * dim), q_sums(rows * groups), weights(rows * kBlockSlots), acc(rows * dim, 0.f),
      base(rows * groups, 0.f), unpacked(dim), scales(groups), lows(groups), block_peak(rows), block_acc(rows * dim),
      block_base(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t c = 0; c < group; ++c) {
        const float value = query[r * dim + g * group + c] * s.scaling;
        q[r * dim + g * group + unpacked_at(KB, c, group)] = value;
        sum += value;
      }
      q_sums[r * groups + g] = sum;
    }
  std::fill(peak, peak + rows, kNone);
  std::fill(total, total + rows, 0.f);
  std::fill(scales.begin(), scales.end(), 1.f);  // float8 rows: a scale of 1 and no minimum
  auto row_meta = [&](const uint8_t* row, int64_t codes) {
    if (KB == kFp8) return;  // (float8 keys come with float8 values only)
    for (int64_t g = 0; g < groups; ++g) {
      scales[g] = half_at(row + codes + 2 * g);
      lows[g] = half_at(row + codes + 2 * (groups + g));
    }
  };
  for (int64_t start = first; start < last; start += kBlockSlots) {
    const int64_t stop = std::min(last, start + kBlockSlots), span = stop - start;
    std::fill(block_peak.begin(), block_peak.end(), kNone);
    for (int64_t j = start; j < stop; ++j) {  // the block's logits
      float* logit = weights.data() + (j - start);
      if (seen && !seen[j]) {
        for (int64_t r = 0; r < rows; ++r) logit[r * kBlockSlots] = kNone;
        continue;
      }
      const uint8_t* row = keys + j * s.key_row;
      unpack<KB>(unpacked.data(), row, dim, group);
      row_meta(row, key_codes);
      for (int64_t r = 0; r < rows; ++r) {
        float value = 0.f;
        for (int64_t g = 0; g < groups; ++g)
          value += scales[g] * dot(q.data() + r * dim + g * group, unpacked.data() + g * group, group) +
                   lows[g] * q_sums[r * groups + g];
        logit[r * kBlockSlots] = value;
        block_peak[r] = std::max(block_peak[r], value);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // weights against the running maximum; what came before rescaled to it
      float* w = weights.data() + r * kBlockSlots;
      const float top = std::max(peak[r], block_peak[r]);
      if (top == kNone) {  // nothing visible yet
        std::fill(w, w + span, 0.f);
        continue;
      }
      if (peak[r] != kNone && peak[r] < top) {
        const float shrink = std::exp(peak[r] - top);
        total[r] *= shrink;
        for (int64_t c = 0; c < dim; ++c) acc[r * dim + c] *= shrink;
        for (int64_t g = 0; g < groups; ++g) base[r * groups + g] *= shrink;
      }
      peak[r] = top;
      float sum = 0.f;
      for (int64_t j = 0; j < span; ++j) {
        w[j] = std::exp(w[j] - top);
        sum += w[j];
      }
      total[r] += sum;
    }
    // the block's values, weighed, summed apart and then added (float32 sums of 128 terms, then of the blocks)
    std::fill(block_acc.begin(), block_acc.end(), 0.f);
    std::fill(block_base.begin(), block_base.end(), 0.f);
    for (int64_t j = start; j < stop; ++j) {
      if (seen && !seen[j]) continue;
      const uint8_t* row = values + j * s.value_row;
      unpack<VB>(unpacked.data(), row, dim, group);
      row_meta(row, value_codes);
      for (int64_t r = 0; r < rows; ++r) {
        const float weight = weights[r * kBlockSlots + (j - start)];
        for (int64_t g = 0; g < groups; ++g) {
          const float scaled = weight * scales[g];
          float* into = block_acc.data() + r * dim + g * group;
          const float* from = unpacked.data() + g * group;
#pragma omp simd
          for (int64_t c = 0; c < group; ++c) into[c] += scaled * from[c];
          block_base[r * groups + g] += weight * lows[g];
        }
      }
    }
    for (int64_t i = 0; i < rows * dim; ++i) acc[i] += block_acc[i];
    for (int64_t i = 0; i < rows * groups; ++i) base[i] += block_base[i];
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t c = 0; c < group; ++c)
        out[r * dim + g * group + c] = acc[r * dim + g * group + unpacked_at(VB, c, group)] + base[r * groups + g];
}

template <int KB, int VB, int64_t G>
void attend(const Shape& s, int64_t batch, const float* query, const uint8_t* keys, const uint8_t* values,
            const bool* visible, float* out) {
  // each (row of the batch, KV head) split into as many slices as keep the threads busy (a slice's partial output
  // is rows x dim floats: a large batch is not split at all)
  const int64_t heads = batch * s.heads, threads = at::get_num_threads();
  const int64_t wanted = (kTasksPerThread * threads + heads - 1) / heads;
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, (s.slots + kBlockSlots - 1) / kBlockSlots));
  const int64_t span = (s.slots + splits - 1) / splits, tasks = heads * splits;
  const int64_t rows = s.rows, dim = s.dim;
  std::vector<float> peaks(tasks * rows), totals(tasks * rows), parts(tasks * rows * dim);
  const int64_t grain = heads * s.slots < kSlotsPerThread ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t split = task % splits, bh = task / splits, b = bh / s.heads, h = bh % s.heads;
      const bool* seen =
          visible ? visible + (b * s.visible_heads + (s.visible_heads > 1 ? h : 0)) * s.slots : nullptr;
      const int64_t first = std::min(s.slots, split * span), last = std::min(s.slots, first + span);
      slice<KB, VB, G>(s, query + bh * rows * dim, keys + bh * s.slots * s.key_row, values + bh * s.slots * s.value_row,
                       seen, first, last, &peaks[task * rows], &totals[task * rows], &parts[task * rows * dim]);
    }
  });
  at::parallel_for(0, heads * rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bh = i / rows, r = i % rows;
      float top = kNone, sum = 0.f;
      for (int64_t k = 0; k < splits; ++k) top = std::max(top, peaks[(bh * splits + k) * rows + r]);
      float* into = out + i * dim;
      std::fill(into, into + dim, 0.f);
      if (top == kNone) continue;  // no visible slot: zeros
      for (int64_t k = 0; k < splits; ++k) {
        const int64_t at = (bh * splits + k) * rows + r;
        if (peaks[at] == kNone) continue;
        const float weight = std::exp(peaks[at] - top);
        sum += weight * totals[at];
        for (int64_t c = 0; c < dim; ++c) into[c] += weight * parts[at * dim + c];
      }
      for (int64_t c = 0; c < dim; ++c) into[c] /= sum;
    }
  });
}

template <int KB, int VB>
void dispatch_group(const Shape& s, int64_t batch, const float* q, const uint8_t* k, const uint8_t* v,
                    const bool* visible, float* out) {
  if (s.group == 64)
    attend<KB, VB, 64>(s, batch, q, k, v, visible, out);
  else
    attend<KB, VB, 0>(s, batch, q, k, v, visible, out);
}

}  // namespace

// query [b, kv_heads, rows, d] (a GQA group's queries stacked as rows); keys / values [b, kv_heads, slots, bytes]
// uint8 rows; visible [b, 1 | kv_heads, 1, slots] bool or None. Returns [b, kv_heads, rows, d] in query's dtype.
torch::Tensor coded_decode_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                                     c10::optional<torch::Tensor> visible, double scaling, int64_t key_bits,
                                     int64_t value_bits) {
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "query, keys and values must be 4-D");
  TORCH_CHECK(keys.scalar_type() == torch::kUInt8 && values.scalar_type() == torch::kUInt8, "rows must be uint8");
  TORCH_CHECK(((key_bits == 4 || key_bits == 8) && (value_bits == 4 || value_bits == 8)) ||
                  (key_bits == 6 && value_bits == 4) || (key_bits == kFp8 && value_bits == kFp8),
              "bits must be 4 or 8 each, or 6 for keys with 4 for values, or float8 (-8) both");
  auto q = query.to(torch::kFloat32).contiguous();
  auto k = keys.contiguous(), v = values.contiguous();
  const int64_t batch = q.size(0), dim = q.size(3), slots = k.size(2);
  const int64_t group = std::gcd<int64_t>(dim, 64);
  Shape shape{q.size(1), q.size(2), slots, dim, group, k.size(3), v.size(3), 1, static_cast<float>(scaling)};
  const int64_t scales = key_bits == kFp8 ? 0 : 4 * (dim / group);  // bytes of a row's scales and minimums
  TORCH_CHECK(k.size(3) == code_bytes(key_bits, dim) + scales, "key rows do not match the head size");
  TORCH_CHECK(v.size(3) == code_bytes(value_bits, dim) + scales, "value rows do not match the head size");
  torch::Tensor seen;
  const bool* seen_ptr = nullptr;
  if (visible.has_value()) {
    seen = visible->to(torch::kBool).expand({batch, visible->size(1), 1, slots}).contiguous();
    seen_ptr = seen.data_ptr<bool>();
    shape.visible_heads = seen.size(1);
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t *kp = k.data_ptr<uint8_t>(), *vp = v.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (key_bits == 4 && value_bits == 4)
    dispatch_group<4, 4>(shape, batch, qp, kp, vp, seen_ptr, op);
  else if (key_bits == 8 && value_bits == 4)
    dispatch_group<8, 4>(shape, batch, qp, kp, vp, seen_ptr, op);
  else if (key_bits == 6)
    dispatch_group<6, 4>(shape, batch, qp, kp, vp, seen_ptr, op);
  else if (key_bits == 4 && value_bits == 8)
    dispatch_group<4, 8>(shape, batch, qp, kp, vp, seen_ptr, op);
  else if (key_bits == kFp8)
    dispatch_group<kFp8, kFp8>(shape, batch, qp, kp, vp, seen_ptr, op);
  else
    dispatch_group<8, 8>(shape, batch, qp, kp, vp, seen_ptr, op);
  return out.to(query.scalar_type());
}
