// y = x @ W.T with W in GGUF k-quant super-blocks, dequantized on the fly (small-M GEMV).
//
// x (M, K) in T, M <= 8; w (N, K / 256 * BLOCK_BYTES) uint8, the tensor's bytes as stored in the
// GGUF file; y (M, N) in OutT. Template: T, OutT, QTYPE (2..6 for Q2_K..Q6_K), NSG (simdgroups per
// threadgroup), R (rows per simdgroup). params (int32): M, N, K.
//
// A super-block holds 256 weights. Every type's bits for weight 128 h + 32 j + l (h < 2, j < 4,
// l < 32) sit at byte offsets that depend on (h, j, l) only, so one lane layout serves all types:
// 16 lanes share a super-block, lane (h, i0) with i0 = 4 * (sub % 8) dequantizes the 16 weights
// 128 h + 32 j + i0 + k (j, k < 4), and the two halves of the simdgroup take alternate
// super-blocks. Each lane dequantizes its 16 weights of R rows once and reuses them for all M rows
// of x; a simd_sum per (row, m) finishes the dot product. The formulas are ggml's
// (dequantize_row_qN_K in ggml-quants.c), in the same float order: w = (d * sc) * q - (dmin * m).

constexpr int MAX_M = 8;
constexpr int QK = 256;
constexpr int BLOCK_BYTES = QTYPE == 2 ? 84 : QTYPE == 3 ? 110 : QTYPE == 4 ? 144 : QTYPE == 5 ? 176 : 210;

const int M = params[0];
const int N = params[1];
const int K = params[2];
const int nb = K / QK;  // super-blocks per row

const int lane = int(thread_index_in_simdgroup);
const int half_ = lane / 16;  // which super-block of a pair
const int sub = lane % 16;
const int h = sub / 8;
const int i0 = (sub % 8) * 4;
const int row0 = (int(threadgroup_position_in_grid.x) * NSG + int(simdgroup_index_in_threadgroup)) * R;

float acc[R][MAX_M];
for (int r = 0; r < R; ++r) {
  for (int mi = 0; mi < MAX_M; ++mi) {
    acc[r][mi] = 0.0f;
  }
}

if (row0 < N) {  // uniform across the simdgroup, so the simd_sums below run on all lanes
  for (int ib = half_; ib < nb; ib += 2) {
    float wq[R][16];  // wq[r][4 j + k]: weight 128 h + 32 j + i0 + k of row row0 + r
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, N - 1);  // rows past N compute a copy, never stored
      const device uint8_t* blk = w + (size_t(row) * nb + ib) * BLOCK_BYTES;
      if (QTYPE == 2) {  // scales[16] qs[64] d dmin
        const float d = float(*((const device half*)(blk + 80)));
        const float dmin = float(*((const device half*)(blk + 82)));
        for (int j = 0; j < 4; ++j) {
          const uint sc = blk[8 * h + 2 * j + i0 / 16];
          const float dl = d * float(sc & 0xF);
          const float ml = dmin * float(sc >> 4);
          for (int k = 0; k < 4; ++k) {
            const uint q = (blk[16 + 32 * h + i0 + k] >> (2 * j)) & 3;
            wq[r][4 * j + k] = dl * float(q) - ml;
          }
        }
      } else if (QTYPE == 3) {  // hmask[32] qs[64] scales[12] d
        const float d = float(*((const device half*)(blk + 108)));
        for (int j = 0; j < 4; ++j) {
          const int is = 8 * h + 2 * j + i0 / 16;  // 6-bit scale: low nibble, then 2 high bits
          const int lo = (blk[96 + is % 8] >> (4 * (is / 8))) & 0xF;
          const int hi = (blk[104 + is % 4] >> (2 * (is / 4))) & 3;
          const float dl = d * float((lo | (hi << 4)) - 32);
          for (int k = 0; k < 4; ++k) {
            const int l = i0 + k;
            const int ql = (blk[32 + 32 * h + l] >> (2 * j)) & 3;
            const int hb = (blk[l] >> (4 * h + j)) & 1;  // a set bit means no -4
            wq[r][4 * j + k] = dl * float(ql - (hb ? 0 : 4));
          }
        }
      } else if (QTYPE == 4 || QTYPE == 5) {  // d dmin scales[12] (qh[32]) qs[128]
        const float d = float(*((const device half*)(blk + 0)));
        const float dmin = float(*((const device half*)(blk + 2)));
        const device uint8_t* s = blk + 4;
        const device uint8_t* qs = blk + (QTYPE == 4 ? 16 : 48);
        for (int j = 0; j < 4; ++j) {
          const int sb = 4 * h + j;  // sub-block of 32 weights
          uint sc, mn;
          if (sb < 4) {
            sc = s[sb] & 63;
            mn = s[sb + 4] & 63;
          } else {
            sc = (s[sb + 4] & 0xF) | ((s[sb - 4] >> 6) << 4);
            mn = (s[sb + 4] >> 4) | ((s[sb] >> 6) << 4);
          }
          const float dl = d * float(sc);
          const float ml = dmin * float(mn);
          for (int k = 0; k < 4; ++k) {
            const int l = i0 + k;
            uint q = (qs[32 * (2 * h + j / 2) + l] >> (4 * (j % 2))) & 0xF;
            if (QTYPE == 5) {
              q |= ((blk[16 + l] >> sb) & 1) << 4;
            }
            wq[r][4 * j + k] = dl * float(q) - ml;
          }
        }
      } else {  // QTYPE == 6: ql[128] qh[64] scales[16] (int8) d
        const float d = float(*((const device half*)(blk + 208)));
        const device int8_t* sc = (const device int8_t*)(blk + 192);
        for (int j = 0; j < 4; ++j) {
          const float dl = d * float(sc[8 * h + 2 * j + i0 / 16]);
          for (int k = 0; k < 4; ++k) {
            const int l = i0 + k;
            const int ql = (blk[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) & 0xF;
            const int qh = (blk[128 + 32 * h + l] >> (2 * j)) & 3;
            wq[r][4 * j + k] = dl * float((ql | (qh << 4)) - 32);
          }
        }
      }
    }
    for (int mi = 0; mi < MAX_M; ++mi) {
      if (mi < M) {
        const device T* xs = x + size_t(mi) * K + ib * QK + 128 * h + i0;
        for (int j = 0; j < 4; ++j) {
          for (int k = 0; k < 4; ++k) {
            const float xv = float(xs[32 * j + k]);
            for (int r = 0; r < R; ++r) {
              acc[r][mi] += wq[r][4 * j + k] * xv;
            }
          }
        }
      }
    }
  }

  for (int r = 0; r < R; ++r) {
    for (int mi = 0; mi < MAX_M; ++mi) {
      if (mi < M) {
        const float sum = simd_sum(acc[r][mi]);
        if (lane == 0 && row0 + r < N) {
          y[size_t(mi) * N + row0 + r] = static_cast<OutT>(sum);
        }
      }
    }
  }
}
