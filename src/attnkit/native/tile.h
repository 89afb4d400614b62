// Vector helpers shared by attnkit's C++ kernels (attnkit/native/*.cpp): vectors of the target's register width,
// their exponential, and the micro-tiles of a FlashAttention-style sweep (Dao et al., 2022, arXiv 2205.14135,
// Algorithm 1): logits of a few query rows against a tile of keys held transposed, and the output update
// O = O * alpha + P V.
//
// One source for every instruction set: the vector type is as wide as one register of the target (VW floats: 16 with
// AVX-512, 8 with AVX2, 4 with SSE or NEON) and the micro-tiles are sized so that their accumulators fit the
// target's register file (32 registers with AVX-512 and NEON, 16 with AVX2 and SSE). A vector wider than the
// registers would be split by the compiler into pieces, its accumulators spilled to the stack and its lane-wise
// selects lowered piece by piece: what a 16-float type costs on AVX2.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#define ATTNKIT_VW 16
#define ATTNKIT_REGS 32
#elif defined(__AVX2__)
#define ATTNKIT_VW 8
#define ATTNKIT_REGS 16
#elif defined(__aarch64__)
#define ATTNKIT_VW 4
#define ATTNKIT_REGS 32
#else
#define ATTNKIT_VW 4
#define ATTNKIT_REGS 16
#endif

// the build's vector width in floats: which instruction set the kernel's vectors were built for
extern "C" int attnkit_vector_width() { return ATTNKIT_VW; }

namespace attnkit {

constexpr int VW = ATTNKIT_VW;
typedef float vf __attribute__((vector_size(4 * ATTNKIT_VW)));
typedef int32_t vi __attribute__((vector_size(4 * ATTNKIT_VW)));
typedef float vfu __attribute__((vector_size(4 * ATTNKIT_VW), aligned(4)));  // the same, at any float's address
typedef float v4 __attribute__((vector_size(16)));

inline vf ld(const float* p) { return *reinterpret_cast<const vfu*>(p); }
// VW bfloat16 values (float32's upper halves, as uint16) widened to floats: the 16 bits moved up, exactly
typedef uint16_t vhu __attribute__((vector_size(2 * ATTNKIT_VW), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(4 * ATTNKIT_VW)));
inline vf ld_bf16(const uint16_t* p) {
    return (vf)(__builtin_convertvector(*reinterpret_cast<const vhu*>(p), vu) << 16);
}
inline void st(float* p, vf x) { *reinterpret_cast<vfu*>(p) = x; }
// x in every lane: x - 0 is x for every float (a broadcast), where x + 0 is not for x = -0.0 (compilers keep that add)
// and lane-by-lane stores become masked moves
inline vf splat(float x) { return x - vf{}; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf lanes() {  // 0, 1, ..., VW - 1
    vf x;
    for (int i = 0; i < VW; ++i) x[i] = static_cast<float>(i);
    return x;
}

// the lower and upper halves of a vector, built lane by lane (compilers turn this into register extracts), down to
// 4 lanes: horizontal maximum and sum by halving, a tree of log2(VW) steps where a loop over the lanes chains VW - 1
#if ATTNKIT_VW == 16
typedef float v8 __attribute__((vector_size(32)));
inline v4 quarter_max(vf x) {
    const v8 lo = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]};
    const v8 hi = {x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]};
    const v8 a = lo > hi ? lo : hi;
    const v4 c = {a[0], a[1], a[2], a[3]}, d = {a[4], a[5], a[6], a[7]};
    return c > d ? c : d;
}
inline v4 quarter_sum(vf x) {
    const v8 a = v8{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]} +
                 v8{x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]};
    return v4{a[0], a[1], a[2], a[3]} + v4{a[4], a[5], a[6], a[7]};
}
#elif ATTNKIT_VW == 8
inline v4 quarter_max(vf x) {
    const v4 c = {x[0], x[1], x[2], x[3]}, d = {x[4], x[5], x[6], x[7]};
    return c > d ? c : d;
}
inline v4 quarter_sum(vf x) { return v4{x[0], x[1], x[2], x[3]} + v4{x[4], x[5], x[6], x[7]}; }
#else
inline v4 quarter_max(vf x) { return x; }
inline v4 quarter_sum(vf x) { return x; }
#endif
inline float hmax(vf x) {
    const v4 e = quarter_max(x);
    return std::max(std::max(e[0], e[1]), std::max(e[2], e[3]));
}
inline float hsum(vf x) {
    const v4 c = quarter_sum(x);
    return (c[0] + c[1]) + (c[2] + c[3]);
}

// exp of every lane, for arguments <= 0 (logits minus their running maximum): a reduction by ln 2 (Cody and Waite's
// two-part constant) and a degree-6 polynomial fitted for the least relative error on [-ln 2 / 2, ln 2 / 2] (about
// 1 ulp, as Cephes' expf). The bias 127 rides in the rounding constant, so n + 127 lands in the low bits of t and
// one shift makes 2^n. From about -87.7 down n + 127 is 0, and so is 2^n's bit pattern: the result is 0, a masked
// logit's -inf included (just above, e^x is subnormal, and so is the result).
inline vf vexp(vf x) {
    x = x < -88.0f ? splat(-88.0f) : x;  // one max instruction; a NaN stays NaN
    const vf t = x * 1.44269504088896341f + 12583039.0f;  // 1.5 * 2^23 + 127
    const vf n = t - 12583039.0f;
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = splat(1.3843653723597527e-3f);
    p = p * r + 8.37415549904108e-3f;
    p = p * r + 4.166800156235695e-2f;
    p = p * r + 1.6666431725025177e-1f;
    p = p * r + 4.999999403953552e-1f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vf)((vi)t << 23);  // the 1.5 * 2^23 part of t's bits falls off the top
}

// 2^x of every lane, for arguments <= 0: the prompt kernels' online softmax works in base 2, its logits scaled by
// log2(e) with the queries (LOG2E), so the reduction is x minus its rounded integer, exact, where e^x needs a
// product by log2(e) and a two-part product by ln 2 (three operations on the FMA units less per lane). A degree-6
// polynomial fitted for the least relative error on [-1/2, 1/2] (about 1 ulp); from -126.5 down, 0 (as vexp).
inline vf vexp2(vf x) {
    x = x < -127.0f ? splat(-127.0f) : x;
    const vf t = x + 12583039.0f;  // 1.5 * 2^23 + 127
    const vf n = t - 12583039.0f;
    const vf r = x - n;
    vf p = splat(1.5353361959569156e-4f);
    p = p * r + 1.3398875016719103e-3f;
    p = p * r + 9.61843691766262e-3f;
    p = p * r + 5.5503323674201965e-2f;
    p = p * r + 2.4022647738456726e-1f;
    p = p * r + 6.931471824645996e-1f;
    p = p * r + 1.0f;
    return p * (vf)((vi)t << 23);
}
constexpr float LOG2E = 1.44269504088896341f;  // the prompt kernels scale their queries by it (softmax_vecs)

// natural log of every lane, for positive normal arguments: Cephes' logf (the mantissa reduced to [sqrt(1/2), sqrt(2)),
// a degree-9 polynomial of it minus 1, about 1 ulp)
inline vf vlog(vf x) {
    const vi bits = (vi)x;
    vi e = ((bits >> 23) & 0xff) - 126;
    const vf m = (vf)((bits & 0x007fffff) | 0x3f000000);  // [1/2, 1)
    const vi small = m < 0.70710678118654752f;
    e += small;                                   // -1 where the mantissa doubles
    const vf f = m + (vf)((vi)m & small) - 1.0f;  // 2m - 1 or m - 1
    const vf z = f * f;
    vf p = splat(7.0376836292e-2f);
    p = p * f - 1.1514610310e-1f;
    p = p * f + 1.1676998740e-1f;
    p = p * f - 1.2420140846e-1f;
    p = p * f + 1.4249322787e-1f;
    p = p * f - 1.6668057665e-1f;
    p = p * f + 2.0000714765e-1f;
    p = p * f - 2.4999993993e-1f;
    p = p * f + 3.3333331174e-1f;
    const vf fe = __builtin_convertvector(e, vf);
    vf y = f * z * p + fe * -2.12194440e-4f - 0.5f * z;
    return f + y + fe * 0.693359375f;
}

// keys per tile; a kernel may set ATTNKIT_TILE_KEYS (a multiple of 64) before including this header: the prompt
// scoring sweep takes 128, whose fixed work per row and tile (the maximum across the row, the rescaling, the
// statistic's bookkeeping) is then spread over twice the keys
#ifndef ATTNKIT_TILE_KEYS
#define ATTNKIT_TILE_KEYS 64
#endif
constexpr int64_t BK = ATTNKIT_TILE_KEYS;
static_assert(BK % 64 == 0, "tiles of a multiple of 64 keys");
// the keys of the kernel's tiles: a caller that sizes what the kernel reads per tile asks
extern "C" int attnkit_key_tile() { return static_cast<int>(BK); }
constexpr int TV = BK / VW;      // vectors per row of a tile
constexpr int64_t QK_ROWS = 4;   // rows of one logits micro-tile
constexpr int QK_VECS = std::min(TV, 4);  // its vectors per row with 32 registers (16 accumulators)
constexpr int64_t PAD = 8;       // rows are padded to a multiple of this (the output micro-tile's rows)

// the rows of values a sweep reads: row j at V + j * ldv (a tile, or a strided tensor), or where at[j] points (rows
// that lie apart, read where they lie instead of copied into a tile first)
struct StridedRows {
    const float* V;
    int64_t ldv;
    const float* operator()(int64_t j) const { return V + j * ldv; }
};
struct ScatteredRows {
    const float* const* at;
    const float* operator()(int64_t j) const { return at[j]; }
};

// O[r] = O[r] * alpha[r] + sum_j P[r][j] V[j] for RW rows and NV vectors of value columns (from column col of each
// row): the same arithmetic wherever the rows lie
template <int RW, int NV, typename Rows>
inline void pv_tile(const float* P, int64_t ldp, Rows rows, int64_t col, int64_t keys, float* O, int64_t ldo,
                    const float* alpha) {
    vf o[RW][NV];
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < NV; ++c) o[r][c] = splat(0.0f);
    for (int64_t j = 0; j < keys; ++j) {
        vf vv[NV];
        const float* row = rows(j) + col;
        for (int c = 0; c < NV; ++c) vv[c] = ld(row + VW * c);
        for (int r = 0; r < RW; ++r) {
            const vf p = splat(P[r * ldp + j]);
            for (int c = 0; c < NV; ++c) o[r][c] += p * vv[c];
        }
    }
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < NV; ++c) st(O + r * ldo + VW * c, ld(O + r * ldo + VW * c) * alpha[r] + o[r][c]);
}

// pv_tile over 4 rows (PAD: 8) and all DV value columns (a multiple of 16), in micro-tiles of at most 16
// accumulators with 32 registers, 8 with 16
template <int ROWS, typename Rows>
inline void pv_rows(const float* P, int64_t ldp, Rows rows, int64_t keys, float* O, int64_t DV, const float* alpha) {
    static_assert(ROWS == 4 || ROWS == 8, "4 or 8 rows");
    constexpr int H = ROWS / 4;  // the tiles of 4 rows (of 8 where a tile has 1 or 2 vectors and 32 registers)
    const int64_t nvec = DV / VW;
    int64_t c = 0;
#if ATTNKIT_REGS >= 32
    for (; c + 4 <= nvec; c += 4)
        for (int h = 0; h < H; ++h)
            pv_tile<4, 4>(P + 4 * h * ldp, ldp, rows, c * VW, keys, O + 4 * h * DV + c * VW, DV, alpha + 4 * h);
    switch (nvec - c) {
        case 3:
            for (int h = 0; h < H; ++h)
                pv_tile<4, 3>(P + 4 * h * ldp, ldp, rows, c * VW, keys, O + 4 * h * DV + c * VW, DV, alpha + 4 * h);
            break;
        case 2: pv_tile<ROWS, 2>(P, ldp, rows, c * VW, keys, O + c * VW, DV, alpha); break;
        case 1: pv_tile<ROWS, 1>(P, ldp, rows, c * VW, keys, O + c * VW, DV, alpha); break;
        default: break;
    }
#else
    for (; c + 2 <= nvec; c += 2)
        for (int h = 0; h < H; ++h)
            pv_tile<4, 2>(P + 4 * h * ldp, ldp, rows, c * VW, keys, O + 4 * h * DV + c * VW, DV, alpha + 4 * h);
    if (c < nvec) pv_tile<ROWS, 1>(P, ldp, rows, c * VW, keys, O + c * VW, DV, alpha);
#endif
}

// pv_rows over rows ldv apart from V
template <int ROWS>
inline void pv_rows(const float* P, int64_t ldp, const float* V, int64_t ldv, int64_t keys, float* O, int64_t DV,
                    const float* alpha) {
    pv_rows<ROWS>(P, ldp, StridedRows{V, ldv}, keys, O, DV, alpha);
}

// logits of QK_ROWS query rows (Q, row stride D, scaled already) against NV vectors of keys held transposed (Kt:
// key-major columns, row stride ldk), into S (row stride BK)
template <int NV>
inline void qk_pass(const float* Q, int64_t D, const float* Kt, int64_t ldk, float* S) {
    vf acc[QK_ROWS][NV];
    for (int rr = 0; rr < QK_ROWS; ++rr)
        for (int c = 0; c < NV; ++c) acc[rr][c] = splat(0.0f);
    for (int64_t d = 0; d < D; ++d) {
        const float* kp = Kt + d * ldk;
        vf k[NV];
        for (int c = 0; c < NV; ++c) k[c] = ld(kp + VW * c);
        for (int rr = 0; rr < QK_ROWS; ++rr) {
            const vf qv = splat(Q[rr * D + d]);
            for (int c = 0; c < NV; ++c) acc[rr][c] += qv * k[c];
        }
    }
    for (int rr = 0; rr < QK_ROWS; ++rr)
        for (int c = 0; c < NV; ++c) st(S + rr * BK + c * VW, acc[rr][c]);
}

// logits of QK_ROWS query rows against BK keys held transposed, in passes whose accumulators fill most of the
// register file: 4 x 4 vectors with 32 registers, 4 x 3, 4 x 3 and 4 x 2 with AVX2's 16 (12 chains of FMAs in
// flight, where 8 would leave each FMA waiting on the one before in its chain)
inline void qk_tile(const float* Q, int64_t D, const float* Kt, int64_t ldk, float* S) {
#if ATTNKIT_REGS >= 32
    for (int c0 = 0; c0 < TV; c0 += QK_VECS) qk_pass<QK_VECS>(Q, D, Kt + c0 * VW, ldk, S + c0 * VW);
#elif ATTNKIT_VW == 8
    for (int c0 = 0; c0 < TV; c0 += 8) {  // each 64 keys
        qk_pass<3>(Q, D, Kt + c0 * VW, ldk, S + c0 * VW);
        qk_pass<3>(Q, D, Kt + (c0 + 3) * VW, ldk, S + (c0 + 3) * VW);
        qk_pass<2>(Q, D, Kt + (c0 + 6) * VW, ldk, S + (c0 + 6) * VW);
    }
#else
    for (int c0 = 0; c0 < TV; c0 += 2) qk_pass<2>(Q, D, Kt + c0 * VW, ldk, S + c0 * VW);
#endif
}

// one row's online softmax over NV vectors of logits s, in base 2 (the queries were scaled by LOG2E: 2^s is e^logit),
// the lanes from `visible` on hidden (as are lanes already -inf): the running maximum M and sum L, the exponentials
// (relative to the new maximum) written to p; returns the factor alpha that rescales what came before. A row that
// has seen no key yet stays at M = -inf, L = 0 with zeros written.
template <int NV>
inline float softmax_vecs(const float* s, int64_t visible, float& M, float& L, float* p) {
    vf x[NV];
    const vf lane = lanes();
    vf top = splat(-INFINITY);
    for (int c = 0; c < NV; ++c) {
        x[c] = ld(s + VW * c);
        if (visible < NV * VW)
            x[c] = lane + static_cast<float>(VW * c) >= static_cast<float>(visible) ? splat(-INFINITY) : x[c];
        top = vmax(top, x[c]);
    }
    const float m = std::max(M, hmax(top));
    if (m == -INFINITY) {
        for (int c = 0; c < NV; ++c) st(p + VW * c, splat(0.0f));
        return 1.0f;
    }
    const float alpha = m == M ? 1.0f : std::exp2(M - m);  // once the row's maximum settles, no exponential
    M = m;
    vf sum = splat(0.0f);
    for (int c = 0; c < NV; ++c) {
        const vf e = vexp2(x[c] - m);
        sum += e;
        st(p + VW * c, e);
    }
    L = L * alpha + hsum(sum);
    return alpha;
}

// softmax_vecs over a tile of BK logits
inline float softmax_tile(const float* s, int64_t visible, float& M, float& L, float* p) {
    return softmax_vecs<TV>(s, visible, M, L, p);
}

// what a worker holds for a block of query rows: the rows' queries (scaled), their logits of a tile, their
// exponentials of a tile or more (row stride ldp), outputs, running sums and maxima, and the last tile's rescaling
// factors
struct RowBuffers {
    std::vector<float> q, s, p, o, l, m, alpha;
    void assign(int64_t rows, int64_t D, int64_t ldp, int64_t DV) {
        q.assign(rows * D, 0.0f);
        s.assign(rows * BK, 0.0f);
        p.assign(rows * ldp, 0.0f);
        o.assign(rows * DV, 0.0f);
        l.assign(rows, 0.0f);
        m.assign(rows, 0.0f);
        alpha.assign(rows, 1.0f);
    }
};

// the keys of B x KV heads (k, strides ks in elements: batch, head, position) transposed tile by tile into kt
// [B * KV, tiles, D, BK]: key j in lane j % width of tile j / width, so a tile's logits are broadcasts of one query
// value times VW contiguous keys, and a tile's D x BK keys lie in one stretch of memory (rows NK apart would fall
// into the same few cache sets). kt is zero-filled by the caller.
inline void transpose_keys(const float* k, const int64_t* ks, int64_t B, int64_t KV, int64_t NK, int64_t D,
                           int64_t width, float* kt) {
    const int64_t tiles = (NK + width - 1) / width;
    for (int64_t bh = 0; bh < B * KV; ++bh)
        for (int64_t j = 0; j < NK; ++j) {
            const float* src = k + (bh / KV) * ks[0] + (bh % KV) * ks[1] + j * ks[2];
            float* dst = kt + ((bh * tiles + j / width) * D) * BK + j % width;
            for (int64_t d = 0; d < D; ++d) dst[d * BK] = src[d];
        }
}

// run(w) for w in 0 .. workers - 1, on that many threads (this one included). A kernel built with OpenMP runs them on
// OpenMP's pool, torch's own where torch links the same runtime: threads that wait between calls, where threads
// started per call cost more than a short sweep and, in a serving engine whose threads are bound to the cores,
// compete with them. Without OpenMP, threads started here; where no more can be had, this one runs the rest.
template <typename Run>
void run_workers(int workers, Run run) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(workers) schedule(static, 1)
    for (int w = 0; w < workers; ++w) run(w);
#else
    std::vector<std::thread> pool;
    int started = 1;
    try {
        for (; started < workers; ++started) pool.emplace_back(run, started);
    } catch (const std::system_error&) {
    }
    run(0);
    for (int w = started; w < workers; ++w) run(w);
    for (auto& th : pool) th.join();
#endif
}

}  // namespace attnkit
