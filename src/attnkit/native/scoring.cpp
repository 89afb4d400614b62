// A prompt's causal attention and its per-key statistics on a CPU, in one sweep over the logits.
//
// What and why: see attnkit/methods/scoring_native.py. In short, H2O (Zhang et al., 2023, arXiv 2306.14048) and
// Keyformer (Adnan et al., MLSys 2024, arXiv 2403.09054, eq. 9 at temperature 1) score each key by a sum, over the
// queries that see it, of a function of the attention those queries give it. torch's operations either materialise
// every logit (a blocked pass) or compute them twice (a flash kernel, then a statistics pass). Here each tile of
// logits is computed once, in the caches: the output by the online softmax of FlashAttention (Dao et al., 2022,
// arXiv 2205.14135, Algorithm 1; Milakov and Gimelshein, 2018, arXiv 1805.02867), and the statistic from the same
// exponentials, kept per query block and rescaled by each row's final log-sum-exp once the block's sweep is done.
//
// Layout: queries q [B, HQ, NQ, D], keys k [B, KV, NK, D], values v [B, KV, NK, DV], float32, the last axis
// contiguous, the other three strided (qs/ks/vs give their strides in elements). The queries are the last NQ of NK
// contiguous positions: query i sits at position NK - NQ + i and sees keys 0 .. NK - NQ + i. Outputs: out
// [B, HQ, NQ, DV] and stats [B, KV, NK] (both contiguous). Without values (v and out null) only the statistic is
// computed, without stats (null) only the output.
//
// The statistic of key j, per kv head: w_ij = p_ij (the attention probability), or, given the factor table,
// p_ij f_ij / sum_j' p_ij' f_ij' with f_ij = table[offsets[h, i] + j] (Keyformer's exp(zeta)); reduced over the
// query heads of the group by their mean (group_max = 0) or maximum, then over the queries by their sum
// (rows_max = 0) or maximum. The table is read as bfloat16 (its entries are bfloat16 values in every host:
// attnkit/methods/keyformer_noise.py): each query row reads its own stretch of a table far larger than the caches, so
// the sweep waits on those reads, and half the bytes halve the wait.
//
// Given a mask of scored keys (KVzip's reconstruction, arXiv 2505.23416: its score's softmax runs over some keys
// while its output attends to all), p_ij is normalised over the scored keys only, exp(l_ij) / sum_{j' scored}
// exp(l_ij'), and the statistic is reduced only over the tiles of keys stat_lo .. stat_hi - 1 (scored keys). The
// running sum of the scored keys' exponentials is relative to each row's maximum over all keys; where it ends below
// UNDERFLOW, the scored keys lie so far below that maximum that their exponentials have lost precision (float32
// turns subnormal near 87 below), and the call returns 4 so the caller scores them in a sweep of their own.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#define ATTNKIT_TILE_KEYS 128  // tiles of 128 keys (tile.h): the sweep's per-tile work over twice the keys
#include "tile.h"

namespace {

using namespace attnkit;

constexpr float UNDERFLOW = 1e-25f;  // the least sum of the scored keys' exponentials trusted (about e^-57.6)
constexpr int SV = std::min(TV, 4);   // vectors of a tile's statistic reduced at once (their accumulators: 8)

struct Problem {
    const float *q, *v, *kt;  // kt: the keys transposed, [B, KV, NKP / BK, D, BK], zero past NK
    const uint16_t* table;    // Keyformer's factors, bfloat16 (null: none)
    const float* scored;              // [NKP]: 1 for a scored key, 0 otherwise (null: every key is scored)
    const uint8_t* tile_kind;         // per key tile: 0 no scored key, 1 all scored, 2 some
    const int64_t* offsets;
    int64_t t_lo, t_hi;               // the tiles whose statistic is reduced
    int64_t qs[3], vs[3];
    int64_t B, HQ, KV, G, NQ, NK, NKP, D, DV, BQ;
    float scale;
    bool group_max, rows_max;
    float *out, *stats;
    std::atomic<bool>* lost;  // set where a row's scored keys lost precision
};

struct Scratch : RowBuffers {  // one worker's buffers, sized for the longest block
    std::vector<float> tile_max, z, coef, stats;
};

// One block: kv head kh of row b, queries i0 .. i0 + BQ - 1 and every query head of the group (R rows).
void run_block(const Problem& a, Scratch& s, int64_t b, int64_t kh, int64_t i0) {
    const int64_t G = a.G, D = a.D, DV = a.DV, nq = std::min(a.NQ, i0 + a.BQ) - i0;
    const int64_t R = G * nq, RP = (R + PAD - 1) / PAD * PAD;
    const int64_t first = a.NK - a.NQ + i0;  // position of the block's first query
    const int64_t seen = first + nq, T = (seen + BK - 1) / BK;
    // P holds the exponentials tile by tile, each tile's rows contiguous (RP x BK floats): the statistic reads the
    // tiles t_lo .. t_hi - 1 once the rows are done, kept from slot 1 on; the output reads only the current tile, and
    // a tile the statistic does not read goes to slot 0, overwritten by the next (KVzip's reconstruction scores a
    // chunk of the keys it attends to: its other tiles would only be written out to memory)
    const bool keep = a.stats != nullptr;
    float *Q = s.q.data(), *P = s.p.data(), *TM = s.tile_max.data(), *O = s.o.data(), *L = s.l.data();
    float *M = s.m.data(), *Z = s.z.data(), *AL = s.alpha.data();
    auto tile = [&](int64_t t) { return P + (keep && t >= a.t_lo && t < a.t_hi ? t - a.t_lo + 1 : 0) * RP * BK; };
    for (int64_t r = 0; r < RP; ++r) {  // row r: query head kh * G + r / nq, query i0 + r % nq; scaled here
        float* dst = Q + r * D;
        if (r < R) {
            const float* src = a.q + b * a.qs[0] + (kh * G + r / nq) * a.qs[1] + (i0 + r % nq) * a.qs[2];
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
        } else {
            std::memset(dst, 0, D * sizeof(float));
        }
    }
    std::fill(O, O + RP * DV, 0.0f);
    std::fill(L, L + RP, 0.0f);
    std::fill(Z, Z + RP, 0.0f);
    std::fill(M, M + RP, -INFINITY);
    std::fill(AL, AL + RP, 1.0f);
    const float* Kt = a.kt + (b * a.KV + kh) * D * a.NKP;  // tile t at Kt + t * D * BK
    const float* V = a.v ? a.v + b * a.vs[0] + kh * a.vs[1] : nullptr;
    float* S = s.s.data();
    for (int64_t t = 0; t < T; ++t) {
        const int64_t j0 = t * BK;
        float* Pt = tile(t);
        // logits of QK_ROWS rows x BK keys; their online softmax (keys after the query's position, and the padding
        // past NK, hidden); the exponentials to P
        for (int64_t r = 0; r < RP; r += QK_ROWS) {
            qk_tile(Q + r * D, D, Kt + t * D * BK, BK, S);
            for (int rr = 0; rr < QK_ROWS && r + rr < R; ++rr) {
                const int64_t row = r + rr, pos = first + row % nq;
                AL[row] = softmax_tile(S + rr * BK, pos - j0 + 1, M[row], L[row], Pt + row * BK);  // sees key 0
                TM[row * T + t] = M[row];
            }
        }
        const int64_t keys = std::min(BK, seen - j0);
        for (int64_t r = 0; a.out && r < RP; r += PAD)
            pv_rows<PAD>(Pt + r * BK, BK, V + j0 * a.vs[2], a.vs[2], keys, O + r * DV, DV, AL + r);
        if (a.table) {  // Keyformer: the exponentials times exp(zeta), and their running sum
            for (int64_t row = 0; row < R; ++row) {
                const uint16_t* f = a.table + a.offsets[(kh * G + row / nq) * a.NQ + i0 + row % nq] + j0;
                float* pr = Pt + row * BK;
                if (t + 2 < T)  // each row reads its own stretch of the table: too many streams for the prefetcher
                    for (int c = 0; c < BK; c += 32) __builtin_prefetch(f + 2 * BK + c);
                vf sum = splat(0.0f);
                for (int c = 0; c < TV; ++c) {
                    const vf w = ld(pr + VW * c) * ld_bf16(f + VW * c);
                    sum += w;
                    st(pr + VW * c, w);
                }
                Z[row] = Z[row] * AL[row] + hsum(sum);
            }
        } else if (a.scored) {  // the running sum of the scored keys' exponentials
            const uint8_t kind = a.tile_kind[t];
            for (int64_t row = 0; row < R; ++row) {
                float add = 0.0f;
                if (kind) {
                    const float* pr = Pt + row * BK;
                    vf sum = splat(0.0f);
                    for (int c = 0; c < TV; ++c)
                        sum += kind == 1 ? ld(pr + VW * c) : ld(pr + VW * c) * ld(a.scored + j0 + VW * c);
                    add = hsum(sum);
                }
                Z[row] = Z[row] * AL[row] + add;
            }
        }
    }
    // the rows are done: the output, and the factor that turns row r's stored exponentials of tile t into
    // its weights, exp(tile max - row max) / (the row's sum of them), divided by G for a mean over the group
    float* C = s.coef.data();
    for (int64_t row = 0; row < R; ++row) {
        const int64_t h = kh * G + row / nq, i = i0 + row % nq;
        if (a.out) {
            float* dst = a.out + ((b * a.HQ + h) * a.NQ + i) * DV;
            const float inv = 1.0f / L[row];
            for (int64_t c = 0; c < DV; ++c) dst[c] = O[row * DV + c] * inv;
        }
        if (!a.stats) continue;
        if (a.scored && Z[row] < UNDERFLOW) a.lost->store(true, std::memory_order_relaxed);
        const float denom = (a.table || a.scored ? Z[row] : L[row]) * (a.group_max ? 1.0f : static_cast<float>(G));
        for (int64_t t = a.t_lo; t < std::min(T, a.t_hi); ++t)  // the tiles the statistic reads
            C[row * T + t] = std::exp2(TM[row * T + t] - M[row]) / denom;
    }
    if (!a.stats) return;
    float* stats = s.stats.data() + (b * a.KV + kh) * a.NKP;
    for (int64_t t = a.t_lo; t < std::min(T, a.t_hi); ++t)
        for (int c0 = 0; c0 < TV; c0 += SV) {  // SV vectors of the tile's keys at a time
            const int64_t j0 = t * BK + c0 * VW;
            const float* Pt = tile(t) + c0 * VW;
            vf acc[SV];
            for (int c = 0; c < SV; ++c) acc[c] = splat(0.0f);
            if (!a.group_max && !a.rows_max) {  // a sum over every row
                for (int64_t row = 0; row < R; ++row) {
                    const vf cf = splat(C[row * T + t]);
                    for (int c = 0; c < SV; ++c) acc[c] += cf * ld(Pt + row * BK + VW * c);
                }
            } else {
                for (int64_t i = 0; i < nq; ++i) {  // per query: its group's heads, then into the column
                    vf g[SV];
                    for (int c = 0; c < SV; ++c) g[c] = splat(0.0f);
                    for (int64_t h = 0; h < G; ++h) {
                        const int64_t row = h * nq + i;
                        const vf cf = splat(C[row * T + t]);
                        for (int c = 0; c < SV; ++c) {
                            const vf w = cf * ld(Pt + row * BK + VW * c);
                            g[c] = a.group_max ? vmax(g[c], w) : g[c] + w;
                        }
                    }
                    for (int c = 0; c < SV; ++c) acc[c] = a.rows_max ? vmax(acc[c], g[c]) : acc[c] + g[c];
                }
            }
            for (int c = 0; c < SV; ++c) {
                float* sp = stats + j0 + VW * c;
                st(sp, a.rows_max ? vmax(ld(sp), acc[c]) : ld(sp) + acc[c]);
            }
        }
}

}  // namespace

// Returns 0, or 1 for shapes the kernel does not take, 2 for a factor table too short for its offsets, 3 when its
// buffers cannot be allocated, 4 when the scored keys' exponentials lost precision (the statistic is then unusable).
extern "C" int attnkit_prompt_statistics(const float* q, const int64_t* qs, const float* k, const int64_t* ks,
                                         const float* v, const int64_t* vs, int64_t B, int64_t HQ, int64_t KV,
                                         int64_t NQ, int64_t NK, int64_t D, int64_t DV, float scale,
                                         const uint16_t* table, int64_t table_len, const int64_t* offsets, int group_max,
                                         int rows_max, int64_t block_queries, const uint8_t* scored, int64_t stat_lo,
                                         int64_t stat_hi, float* out, float* stats, int threads) {
    if (B < 1 || KV < 1 || HQ % KV || NQ < 1 || NQ > NK || D < 1 || block_queries < 1) return 1;
    if ((v == nullptr) != (out == nullptr) || (v && (DV < 16 || DV % 16)) || (!out && !stats)) return 1;
    if (stat_lo < 0 || stat_lo > stat_hi || stat_hi > NK || (scored && table)) return 1;
    Problem a;
    a.q = q;
    a.v = v;
    a.table = table;
    a.offsets = offsets;
    for (int i = 0; i < 3; ++i) a.qs[i] = qs[i], a.vs[i] = vs[i];
    a.B = B, a.HQ = HQ, a.KV = KV, a.G = HQ / KV, a.NQ = NQ, a.NK = NK, a.D = D, a.DV = DV, a.BQ = block_queries;
    a.NKP = (NK + BK - 1) / BK * BK;
    a.scale = scale * LOG2E;  // logits in base 2 (softmax_vecs)
    a.group_max = group_max != 0, a.rows_max = rows_max != 0;
    a.out = out, a.stats = stats;
    a.t_lo = stat_lo / BK, a.t_hi = (stat_hi + BK - 1) / BK;
    std::atomic<bool> lost(false);
    a.lost = &lost;
    if (table) {  // every row reads table[offset .. offset + NKP - 1] (the last tile's padding included)
        for (int64_t r = 0; r < HQ * NQ; ++r)
            if (offsets[r] < 0 || offsets[r] + a.NKP > table_len) return 2;
    }
    const int64_t blocks = (NQ + a.BQ - 1) / a.BQ, work = B * KV * blocks;
    const int64_t RP = (a.G * a.BQ + PAD - 1) / PAD * PAD, T = a.NKP / BK;
    const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, work)));
    // every buffer is allocated here, before any worker starts, so a failed allocation is a return code
    std::vector<float> kt, mask;
    std::vector<uint8_t> kinds;
    std::vector<Scratch> scratch(workers);
    try {
        kt.assign(static_cast<size_t>(B * KV * D * a.NKP), 0.0f);
        if (scored) {
            mask.assign(a.NKP, 0.0f);
            kinds.assign(T, 0);
        }
        for (Scratch& s : scratch) {
            s.assign(RP, D, (stats ? a.t_hi - a.t_lo + 1 : 1) * BK, DV);  // P: the kept tiles and slot 0
            s.tile_max.assign(RP * T, 0.0f);
            s.coef.assign(RP * T, 0.0f);
            s.z.assign(RP, 0.0f);
            s.stats.assign(stats ? B * KV * a.NKP : 0, 0.0f);
        }
    } catch (const std::bad_alloc&) {
        return 3;
    }
    transpose_keys(k, ks, B, KV, NK, D, BK, kt.data());
    a.kt = kt.data();
    a.scored = nullptr, a.tile_kind = nullptr;
    if (scored) {
        for (int64_t j = 0; j < NK; ++j) mask[j] = scored[j] ? 1.0f : 0.0f;
        for (int64_t t = 0; t < T; ++t) {
            int64_t count = 0;
            for (int64_t j = t * BK; j < (t + 1) * BK; ++j) count += mask[j] != 0.0f;
            kinds[t] = count == 0 ? 0 : count == BK ? 1 : 2;
        }
        a.scored = mask.data();
        a.tile_kind = kinds.data();
    }
    // block n of the list, longest rows first, goes to worker n % workers: a fixed split, so the sums (each worker's
    // in its own order, then the workers' in theirs) depend on the thread count only, never on timing
    auto run = [&](int w) {
        for (int64_t n = w; n < work; n += workers) {
            const int64_t block = blocks - 1 - n / (B * KV), bh = n % (B * KV);
            run_block(a, scratch[w], bh / KV, bh % KV, block * a.BQ);
        }
    };
    run_workers(workers, run);
    for (int64_t bh = 0; stats && bh < B * KV; ++bh)
        for (int64_t j = 0; j < NK; ++j) {
            float acc = scratch[0].stats[bh * a.NKP + j];
            for (int w = 1; w < workers; ++w) {
                const float x = scratch[w].stats[bh * a.NKP + j];
                acc = a.rows_max ? std::max(acc, x) : acc + x;
            }
            stats[bh * NK + j] = acc;
        }
    return lost.load() ? 4 : 0;
}
