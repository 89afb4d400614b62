// Vector helpers shared by attnkit's C++ kernels (attnkit/native/*.cpp): 16-float vectors, their exponential, and the
// micro-tiles of a FlashAttention-style sweep (Dao et al., 2022, arXiv 2205.14135, Algorithm 1): logits of a few
// query rows against a tile of keys held transposed, and the output update O = O * alpha + P V.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace attnkit {

// 16 floats in GCC/Clang's portable vector extension: the compiler maps them onto the target's widest registers
// (one AVX-512 register, two AVX or four NEON registers).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // the same, at any float's address

inline v16 ld(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void st(float* p, v16 x) { *reinterpret_cast<v16u*>(p) = x; }
inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
// horizontal maximum and sum by halving (a tree of four steps, where a loop over the lanes chains fifteen); the
// halves are built lane by lane, which compilers turn into register extracts
inline float hmax(v16 x) {
    const v8 lo = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]};
    const v8 hi = {x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]};
    const v8 a = lo > hi ? lo : hi;
    const v4 c = {a[0], a[1], a[2], a[3]}, d = {a[4], a[5], a[6], a[7]};
    const v4 e = c > d ? c : d;
    return std::max(std::max(e[0], e[1]), std::max(e[2], e[3]));
}
inline float hsum(v16 x) {
    const v8 a = v8{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]} +
                 v8{x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]};
    const v4 c = v4{a[0], a[1], a[2], a[3]} + v4{a[4], a[5], a[6], a[7]};
    return (c[0] + c[1]) + (c[2] + c[3]);
}

// exp of every lane, for arguments <= 0 (logits minus their running maximum): Cephes' expf (a reduction by ln 2 and
// a degree-5 polynomial, about 1 ulp), 0 below -87.3 where float32 turns subnormal, so a masked -inf gives 0.
inline v16 vexp(v16 x) {
    const v16i dead = x < -87.3f;
    x = dead ? splat(-87.3f) : x;
    const v16 t = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: the rounded multiple of ln 2 in the low bits
    const v16 n = t - 12582912.0f;
    const v16i ni = (v16i)t - 0x4B400000;  // a vector cast keeps the bits
    const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v16i scale = (ni + 127) << 23;  // 2^n
    const v16 y = (p * r * r + r + 1.0f) * (v16)scale;
    return dead ? splat(0.0f) : y;
}

constexpr int64_t BK = 64;      // keys per tile
constexpr int64_t QK_ROWS = 4;  // rows of one logits micro-tile (4 x 64 logits in 16 registers)
constexpr int64_t PAD = 8;      // rows are padded to a multiple of this (the output micro-tile's rows)

// O[r] = O[r] * alpha[r] + sum_j P[r][j] V[j] for RW rows and NV blocks of 16 value columns
template <int RW, int NV>
inline void pv_tile(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t keys, float* O, int64_t ldo,
                    const float* alpha) {
    v16 o[RW][NV];
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < NV; ++c) o[r][c] = splat(0.0f);
    for (int64_t j = 0; j < keys; ++j) {
        v16 vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = ld(V + j * ldv + 16 * c);
        for (int r = 0; r < RW; ++r) {
            const v16 p = splat(P[r * ldp + j]);
            for (int c = 0; c < NV; ++c) o[r][c] += p * vv[c];
        }
    }
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < NV; ++c) st(O + r * ldo + 16 * c, ld(O + r * ldo + 16 * c) * alpha[r] + o[r][c]);
}

// pv_tile over PAD rows and all DV value columns
inline void pv_rows(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t keys, float* O, int64_t DV,
             const float* alpha) {
    int64_t c = 0;
    for (; c + 64 <= DV; c += 64) {
        pv_tile<4, 4>(P, ldp, V + c, ldv, keys, O + c, DV, alpha);
        pv_tile<4, 4>(P + 4 * ldp, ldp, V + c, ldv, keys, O + 4 * DV + c, DV, alpha + 4);
    }
    switch (DV - c) {
        case 48:
            pv_tile<4, 3>(P, ldp, V + c, ldv, keys, O + c, DV, alpha);
            pv_tile<4, 3>(P + 4 * ldp, ldp, V + c, ldv, keys, O + 4 * DV + c, DV, alpha + 4);
            break;
        case 32: pv_tile<8, 2>(P, ldp, V + c, ldv, keys, O + c, DV, alpha); break;
        case 16: pv_tile<8, 1>(P, ldp, V + c, ldv, keys, O + c, DV, alpha); break;
        default: break;
    }
}

// logits of QK_ROWS query rows (Q, row stride D, scaled already) against 64 keys held transposed (Kt: key-major
// columns, row stride ldk): acc[row][16-key block]
inline void qk_tile(const float* Q, int64_t D, const float* Kt, int64_t ldk, v16 acc[QK_ROWS][4]) {
    for (int rr = 0; rr < QK_ROWS; ++rr)
        for (int c = 0; c < 4; ++c) acc[rr][c] = splat(0.0f);
    for (int64_t d = 0; d < D; ++d) {
        const float* kp = Kt + d * ldk;
        const v16 k0 = ld(kp), k1 = ld(kp + 16), k2 = ld(kp + 32), k3 = ld(kp + 48);
        for (int rr = 0; rr < QK_ROWS; ++rr) {
            const v16 qv = splat(Q[rr * D + d]);
            acc[rr][0] += qv * k0;
            acc[rr][1] += qv * k1;
            acc[rr][2] += qv * k2;
            acc[rr][3] += qv * k3;
        }
    }
}

// one row's online softmax over a tile of 64 logits (-inf where hidden): the running maximum M and sum L, the tile's
// exponentials (relative to the new maximum) written to p; returns the factor alpha that rescales what came before.
// A row that has seen no key yet stays at M = -inf, L = 0 with zeros written.
inline float softmax_tile(v16 acc[4], float& M, float& L, float* p) {
    const float top = hmax(vmax(vmax(acc[0], acc[1]), vmax(acc[2], acc[3])));
    const float m = std::max(M, top);
    if (m == -INFINITY) {
        for (int c = 0; c < 4; ++c) st(p + 16 * c, splat(0.0f));
        return 1.0f;
    }
    const float alpha = m == M ? 1.0f : std::exp(M - m);  // once the row's maximum settles, no exponential
    M = m;
    v16 sum = splat(0.0f);
    for (int c = 0; c < 4; ++c) {
        const v16 e = vexp(acc[c] - m);
        sum += e;
        st(p + 16 * c, e);
    }
    L = L * alpha + hsum(sum);
    return alpha;
}

// what a worker holds for a block of query rows: the rows' queries (scaled), their exponentials of a tile or more
// (row stride ldp), outputs, running sums and maxima, and the last tile's rescaling factors
struct RowBuffers {
    std::vector<float> q, p, o, l, m, alpha;
    void assign(int64_t rows, int64_t D, int64_t ldp, int64_t DV) {
        q.assign(rows * D, 0.0f);
        p.assign(rows * ldp, 0.0f);
        o.assign(rows * DV, 0.0f);
        l.assign(rows, 0.0f);
        m.assign(rows, 0.0f);
        alpha.assign(rows, 1.0f);
    }
};

// the keys of B x KV heads (k, strides ks in elements: batch, head, position) transposed into kt [B * KV, D, NKP],
// so a tile's logits are broadcasts of one query value times 16 contiguous keys (kt is zero-filled by the caller)
inline void transpose_keys(const float* k, const int64_t* ks, int64_t B, int64_t KV, int64_t NK, int64_t D,
                           int64_t NKP, float* kt) {
    for (int64_t bh = 0; bh < B * KV; ++bh)
        for (int64_t j = 0; j < NK; ++j) {
            const float* src = k + (bh / KV) * ks[0] + (bh % KV) * ks[1] + j * ks[2];
            float* dst = kt + bh * D * NKP + j;
            for (int64_t d = 0; d < D; ++d) dst[d * NKP] = src[d];
        }
}

// run(w) for w in 0 .. workers - 1, on that many threads (this one included); where no more threads can be had,
// this one runs the rest
template <typename Run>
void run_workers(int workers, Run run) {
    std::vector<std::thread> pool;
    int started = 1;
    try {
        for (; started < workers; ++started) pool.emplace_back(run, started);
    } catch (const std::system_error&) {
    }
    run(0);
    for (int w = started; w < workers; ++w) run(w);
    for (auto& th : pool) th.join();
}

}  // namespace attnkit
