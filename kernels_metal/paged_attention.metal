// Paged decode attention, one new query token per sequence (FlashDecoding, pass 1).
//
// The wrapper prepends four defines:
//   K_BITS   0: k_pool holds floats (num_blocks, block_size, Hkv, D)
//            4 or 8: uint32 words packed by mx.quantize along D (num_blocks, block_size, Hkv,
//            D * K_BITS / 32), with k_scales/k_biases (.., Hkv, D / group_size)
//   V_BITS   the same for v_pool, v_scales/v_biases. Keys and values may differ (8-bit keys with
//            4-bit values: keys are the sensitive half); both 0 or both quantized (the wrapper
//            builds no float/quantized mix, so the scale inputs exist exactly when K_BITS > 0).
//   K_CHANNEL 1 (K_BITS > 0 only): per-channel keys (KIVI). k_pool is packed as above, but the
//            keys' scales and biases are per (block, kv head, channel), shared by the block's
//            tokens: k_scales/k_biases (num_blocks, block_size, Hkv, D / block_size), entry
//            (blk, i, h, g) for channel g * block_size + i (block_size divides D). Values as above.
//   DIRECT   1: one partition covers the sequence; write the normalized output `out` (B, Hq, D).
//            0: write this partition's normalized output o_part (B, Hq, P, D) and its running
//            max / sum ml_part (B, Hq, P, 2); paged_attention_reduce.metal combines them.
// Template: T (q and out dtype), D (head dim, a multiple of 8, at most 128), NSG (simdgroups per
// threadgroup, at least 4 so that NSG * 32 >= D).
// params (int32): Hq, Hkv, block_size, max_blocks_per_seq, partition_size, num_partitions,
// group_size, window. window > 0: a sliding window, the query (at position seq_len - 1) reads only
// the last `window` keys, positions >= seq_len - window; the partitions cover those (table entries
// before them are never read: their blocks may have been freed). 0: every key. qscale (float32): softmax scale * log2(e), so the softmax runs in base 2.
//
// One threadgroup per (partition, q head, sequence). A key is read by L lanes of C = 8 contiguous
// elements each (L = D / 8 rounded up to a power of two, so that the dot product reduces with an
// xor butterfly inside an aligned group of lanes); a simdgroup therefore reads KPS = 32 / L keys
// per step and keeps one online-softmax state (m, l, acc) per key slot. Key slots are merged with
// shuffles, simdgroups through threadgroup memory. GQA: q head h reads kv head h / (Hq / Hkv), and
// the Hq / Hkv heads sharing it run in neighbouring threadgroups, so their KV reads hit the cache.
// Every simd_shuffle runs on all 32 lanes: the token loop bound depends only on the simdgroup.

#if K_CHANNEL && K_BITS == 0
#error "K_CHANNEL needs quantized keys (K_BITS 4 or 8)"
#endif

constexpr int C = 8;
constexpr int L = D <= 64 ? 8 : 16;
constexpr int KPS = 32 / L;
// Scores start at the lowest finite float, not -inf: exp2(lowest - x) is 0 and merging two empty
// states gives exp2(0) * 0, so no special cases (and no reliance on infinities under fast math).
constexpr float M_EMPTY = -metal::numeric_limits<float>::max();

const int Hq = params[0];
const int Hkv = params[1];
const int block_size = params[2];
const int max_blocks = params[3];
const int partition_size = params[4];
const int num_partitions = params[5];
const int group_size = params[6];
const int window = params[7];

const int part = int(threadgroup_position_in_grid.x);
const int hq = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int sg = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int tid = int(thread_position_in_threadgroup.x);

const int ks = lane / L;  // key slot within a step
const int d0 = (lane % L) * C;  // first of this lane's C elements of D
const bool active = d0 < D;
const int hkv = hq / (Hq / Hkv);

const int seq_len = seq_lens[b];
const int t_first = (window > 0 && seq_len > window) ? seq_len - window : 0;  // the window's first key
const int t_begin = t_first + part * partition_size;
const int t_end = min(seq_len, t_begin + partition_size);
const device int* table = block_tables + size_t(b) * max_blocks;

// q, pre-scaled; qsum lets a quantized dot product fold in the bias: q.(s k + z) = s q.k + z sum(q)
float qv[C];
float qsum = 0.0f;
for (int i = 0; i < C; ++i) {
  qv[i] = active ? float(q[(size_t(b) * Hq + hq) * D + d0 + i]) * qscale[0] : 0.0f;
  qsum += qv[i];
}

float m = M_EMPTY;  // running max of scores (base 2)
float l = 0.0f;  // running sum of exp2(score - m)
float acc[C];  // running sum of exp2(score - m) * v
for (int i = 0; i < C; ++i) {
  acc[i] = 0.0f;
}

// elements (float) or uint32 words (quantized) per (token, kv head) row of each pool
constexpr int k_row_elems = K_BITS == 0 ? D : D * K_BITS / 32;
constexpr int v_row_elems = V_BITS == 0 ? D : D * V_BITS / 32;
#if K_BITS != 0 || V_BITS != 0
const int groups = D / group_size;
const int g = d0 / group_size;  // a lane's C elements lie in one group: group_size % 8 == 0
#endif
#if K_CHANNEL
// Per-channel key scales of block blk, kv head hkv, channel d sit at
//   ((blk * block_size + d % block_size) * Hkv + hkv) * (D / block_size) + d / block_size
//   = blk * Hkv * D + k_ch[i]   (block_size * (D / block_size) = D),
// so a lane's offsets for its channels d0 + i are fixed; any block_size dividing D.
int k_ch[C];
for (int i = 0; i < C; ++i) {
  const int d = active ? d0 + i : 0;
  k_ch[i] = ((d % block_size) * Hkv + hkv) * (D / block_size) + d / block_size;
}
#endif

for (int t0 = t_begin + sg * KPS; t0 < t_end; t0 += NSG * KPS) {
  const int t = t0 + ks;
  const bool valid = t < t_end;
  size_t row = 0;  // (physical token, kv head) index into the pools
  int block = 0;
  float s = 0.0f;
  if (valid) {
    block = table[t / block_size];
    row = (size_t(block) * block_size + t % block_size) * Hkv + hkv;
  }
  if (valid && active) {
#if K_BITS == 0
    auto kr = k_pool + row * k_row_elems + d0;
    for (int i = 0; i < C; ++i) {
      s += qv[i] * float(kr[i]);
    }
#elif K_CHANNEL
    // s = sum_i q_i (scale_d code_d + bias_d): the scale varies along D, no factoring out
    const device uint32_t* kr = k_pool + row * k_row_elems + d0 * K_BITS / 32;
    const size_t kc = size_t(block) * Hkv * D;  // this block's per-channel scales and biases
    for (int w = 0; w < C * K_BITS / 32; ++w) {
      const uint32_t word = kr[w];
      for (int j = 0; j < 32 / K_BITS; ++j) {
        const int i = w * (32 / K_BITS) + j;
        const float code = float((word >> (j * K_BITS)) & ((1u << K_BITS) - 1u));
        s += qv[i] * (float(k_scales[kc + k_ch[i]]) * code + float(k_biases[kc + k_ch[i]]));
      }
    }
#else
    float qk = 0.0f;
    const device uint32_t* kr = k_pool + row * k_row_elems + d0 * K_BITS / 32;
    for (int w = 0; w < C * K_BITS / 32; ++w) {
      const uint32_t word = kr[w];
      for (int j = 0; j < 32 / K_BITS; ++j) {
        qk += qv[w * (32 / K_BITS) + j] * float((word >> (j * K_BITS)) & ((1u << K_BITS) - 1u));
      }
    }
    s = float(k_scales[row * groups + g]) * qk + float(k_biases[row * groups + g]) * qsum;
#endif
  }
  // dot product: sum over the L lanes of this key
  for (int o = L / 2; o > 0; o >>= 1) {
    s += simd_shuffle(s, ushort(lane ^ o));
  }
  if (valid) {
    const float m_new = max(m, s);
    const float corr = exp2(m - m_new);  // 0 on the first key
    const float e = exp2(s - m_new);
    m = m_new;
    l = l * corr + e;
    if (active) {
#if V_BITS == 0
      auto vr = v_pool + row * v_row_elems + d0;
      for (int i = 0; i < C; ++i) {
        acc[i] = acc[i] * corr + e * float(vr[i]);
      }
#else
      const device uint32_t* vr = v_pool + row * v_row_elems + d0 * V_BITS / 32;
      const float vs = float(v_scales[row * groups + g]);
      const float vb = float(v_biases[row * groups + g]);
      for (int w = 0; w < C * V_BITS / 32; ++w) {
        const uint32_t word = vr[w];
        for (int j = 0; j < 32 / V_BITS; ++j) {
          const float vq = float((word >> (j * V_BITS)) & ((1u << V_BITS) - 1u));
          acc[w * (32 / V_BITS) + j] = acc[w * (32 / V_BITS) + j] * corr + e * (vs * vq + vb);
        }
      }
#endif
    }
  }
}

// merge the KPS key slots of this simdgroup: lanes lane and lane ^ o hold the same d0
for (int o = L; o < 32; o <<= 1) {
  const float m_o = simd_shuffle(m, ushort(lane ^ o));
  const float l_o = simd_shuffle(l, ushort(lane ^ o));
  const float m_new = max(m, m_o);
  const float f = exp2(m - m_new);
  const float f_o = exp2(m_o - m_new);
  for (int i = 0; i < C; ++i) {
    const float acc_o = simd_shuffle(acc[i], ushort(lane ^ o));
    acc[i] = acc[i] * f + acc_o * f_o;
  }
  l = l * f + l_o * f_o;
  m = m_new;
}

// merge the simdgroups
threadgroup float tg_m[NSG];
threadgroup float tg_l[NSG];
constexpr int tg_acc_size = NSG * D;  // a named size: the interpreter's translator reads
threadgroup float tg_acc[tg_acc_size];  // a `*` in a threadgroup declaration as a pointer
if (lane == 0) {
  tg_m[sg] = m;
  tg_l[sg] = l;
}
if (ks == 0 && active) {
  for (int i = 0; i < C; ++i) {
    tg_acc[sg * D + d0 + i] = acc[i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (tid < D) {
  float m_all = M_EMPTY;
  for (int s = 0; s < NSG; ++s) {
    m_all = max(m_all, tg_m[s]);
  }
  float l_all = 0.0f;
  float o = 0.0f;
  for (int s = 0; s < NSG; ++s) {
    const float f = exp2(tg_m[s] - m_all);
    l_all += tg_l[s] * f;
    o += tg_acc[s * D + tid] * f;
  }
  o = l_all > 0.0f ? o / l_all : 0.0f;  // an empty partition (or sequence) gives 0
#if DIRECT
  out[(size_t(b) * Hq + hq) * D + tid] = static_cast<T>(o);
#else
  const size_t slot = (size_t(b) * Hq + hq) * num_partitions + part;
  o_part[slot * D + tid] = o;
  if (tid == 0) {
    ml_part[slot * 2 + 0] = m_all;
    ml_part[slot * 2 + 1] = l_all;
  }
#endif
}
