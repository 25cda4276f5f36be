// Paged decode attention, pass 2: merge the per-partition results of paged_attention.metal.
//
// o_part (B, Hq, P, D) float32, each partition's output normalized by its own sum;
// ml_part (B, Hq, P, 2) float32, each partition's max score (base 2) and sum of exp2(score - max);
// out (B, Hq, D) in T. Template: T, D. params (int32): num_partitions, Hq.
// One threadgroup of D threads per (q head, sequence), one thread per element of D:
//   out = sum_p o_p * l_p * 2^(m_p - M) / sum_p l_p * 2^(m_p - M),  M = max_p m_p.
// Empty partitions have l_p = 0 (and m_p the lowest finite float) and drop out.

const int P = params[0];
const int d = int(thread_position_in_threadgroup.x);
const size_t head = size_t(threadgroup_position_in_grid.z) * params[1]
    + threadgroup_position_in_grid.y;  // b * Hq + hq
const device float* ml = ml_part + head * P * 2;
const device float* o = o_part + head * P * D;

float m_all = -metal::numeric_limits<float>::max();  // empty partitions hold this too
for (int p = 0; p < P; ++p) {
  m_all = max(m_all, ml[2 * p]);
}
float l_all = 0.0f;
float acc = 0.0f;
for (int p = 0; p < P; ++p) {
  const float l_p = ml[2 * p + 1];
  if (l_p > 0.0f) {
    const float w = l_p * exp2(ml[2 * p] - m_all);
    l_all += w;
    acc += w * o[size_t(p) * D + d];
  }
}
out[head * D + d] = static_cast<T>(l_all > 0.0f ? acc / l_all : 0.0f);
