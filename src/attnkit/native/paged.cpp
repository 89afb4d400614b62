// One decoding query's attention over chosen pages of its kv head's cache, on a CPU: Quest's step (Tang et al., 2024,
// "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774), reading only the keys
// and values of those pages.
//
// What and why: see attnkit/methods/quest_native.py. torch can only gather the chosen pages into new tensors and
// then attend over the copy (each chosen entry read, written and read again, by a dozen small operations); here each
// chosen entry is read once from the cache into a tile of 64 slots that stays in the worker's caches (keys
// transposed, values in rows), and each tile is swept with the prompt kernels' micro-tiles (tile.h) and an online
// softmax (Milakov and Gimelshein, 2018, arXiv 1805.02867) for every query head that chose its pages (a kv group
// shares its pages).
//
// Layout: queries q [B, HQ, D], keys k [B, KV, S, D], values v [B, KV, S, DV], float32, the last axis contiguous,
// the others strided (qs: batch, head; ks/vs: batch, head, slot; in elements). pages [B, KV, C, P] (contiguous):
// the pages each kv head reads, C = 1 (the group shares them) or C = HQ / KV (each query head its own). Page p holds
// slots p * page_size .. (p + 1) * page_size - 1; slots at or past `length`, and below `lo` (a sliding window's
// first visible slot), are skipped. Output out [B, HQ, DV] (contiguous). Query rows are spread over `threads`
// workers when the work is large enough to pay for them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "tile.h"

namespace {

using namespace attnkit;

struct Problem {
    const float *q, *k, *v;
    const int64_t* pages;
    int64_t qs[2], ks[3], vs[3];
    int64_t HQ, KV, G, C, P, D, DV, page_size, length, lo;
    float scale;
    float* out;
};

// what one worker holds: the unit's queries (scaled, padded to QK_ROWS rows), their logits, exponentials and
// outputs, running maxima and sums (RowBuffers), and a tile of up to BK gathered keys (transposed) and values
struct Scratch : RowBuffers {
    std::vector<float> kg, vg;
};

// the tile's `n` gathered keys into the online softmax of the unit's rows (padded rows see none), then the output
// update from their values
void sweep(const Problem& a, Scratch& s, int64_t rows, int64_t n) {
    const int64_t RP = (rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
    float *P = s.p.data(), *S = s.s.data(), *AL = s.alpha.data();
    for (int64_t r = 0; r < RP; r += QK_ROWS) {
        qk_tile(s.q.data() + r * a.D, a.D, s.kg.data(), BK, S);
        for (int rr = 0; rr < QK_ROWS; ++rr)
            AL[r + rr] = softmax_tile(S + rr * BK, r + rr < rows ? n : 0, s.m[r + rr], s.l[r + rr], P + (r + rr) * BK);
    }
    if (a.DV % 16 == 0) {
        for (int64_t r = 0; r < RP; r += QK_ROWS)
            pv_rows<QK_ROWS>(P + r * BK, BK, s.vg.data(), a.DV, n, s.o.data() + r * a.DV, a.DV, AL + r);
        return;
    }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < a.DV; ++e) {
            float o = s.o[r * a.DV + e] * AL[r];
            for (int64_t j = 0; j < n; ++j) o += P[r * BK + j] * s.vg[j * a.DV + e];
            s.o[r * a.DV + e] = o;
        }
}

// unit u = (b, kv head, choice): the query heads that read one list of pages (the whole group when C = 1, else one
// head); the chosen slots gathered BK at a time (keys transposed, values in rows) and swept like a prompt's tile
void run_unit(const Problem& a, int64_t u, Scratch& s) {
    const int64_t b = u / (a.KV * a.C), kh = (u / a.C) % a.KV, c = u % a.C;
    const int64_t rows = a.C == 1 ? a.G : 1, h0 = kh * a.G + (a.C == 1 ? 0 : c);
    const int64_t RP = (rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
    const float* K = a.k + b * a.ks[0] + kh * a.ks[1];
    const float* V = a.v + b * a.vs[0] + kh * a.vs[1];
    const int64_t* pages = a.pages + ((b * a.KV + kh) * a.C + c) * a.P;
    std::fill(s.q.begin(), s.q.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const float* src = a.q + b * a.qs[0] + (h0 + r) * a.qs[1];
        for (int64_t d = 0; d < a.D; ++d) s.q[r * a.D + d] = src[d] * a.scale;
    }
    std::fill(s.o.begin(), s.o.begin() + RP * a.DV, 0.0f);
    std::fill(s.m.begin(), s.m.begin() + RP, -INFINITY);
    std::fill(s.l.begin(), s.l.begin() + RP, 0.0f);
    float *Kg = s.kg.data(), *Vg = s.vg.data();
    int64_t n = 0;  // slots gathered into the tile
    for (int64_t i = 0; i < a.P; ++i) {
        const int64_t first = std::max(pages[i] * a.page_size, a.lo);
        const int64_t last = std::min((pages[i] + 1) * a.page_size, a.length);
        if (i + 1 < a.P) {  // the next page lies anywhere in the cache: its lines asked for while this one is read
            const int64_t next = pages[i + 1] * a.page_size;
            for (int64_t j = next; j < std::min(next + a.page_size, a.length); ++j) {
                for (int64_t d = 0; d < a.D; d += 16) __builtin_prefetch(K + j * a.ks[2] + d);
                for (int64_t e = 0; e < a.DV; e += 16) __builtin_prefetch(V + j * a.vs[2] + e);
            }
        }
        for (int64_t j = first; j < last; ++j) {
            const float* kp = K + j * a.ks[2];
            for (int64_t d = 0; d < a.D; ++d) Kg[d * BK + n] = kp[d];
            std::copy(V + j * a.vs[2], V + j * a.vs[2] + a.DV, Vg + n * a.DV);
            if (++n == BK) {
                sweep(a, s, rows, n);
                n = 0;
            }
        }
    }
    if (n) sweep(a, s, rows, n);
    for (int64_t r = 0; r < rows; ++r) {
        float* o = a.out + (b * a.HQ + h0 + r) * a.DV;
        const float inv = s.l[r] > 0.0f ? 1.0f / s.l[r] : 0.0f;
        for (int64_t e = 0; e < a.DV; ++e) o[e] = s.o[r * a.DV + e] * inv;
    }
}

}  // namespace

extern "C" int attnkit_paged_decode(const float* q, const int64_t* qs, const float* k, const int64_t* ks,
                                    const float* v, const int64_t* vs, const int64_t* pages, int64_t B, int64_t HQ,
                                    int64_t KV, int64_t C, int64_t P, int64_t D, int64_t DV, int64_t page_size,
                                    int64_t length, int64_t lo, float scale, float* out, int threads) {
    if (KV <= 0 || HQ % KV || page_size <= 0 || (C != 1 && C != HQ / KV)) return 1;
    Problem a{q, k, v, pages, {qs[0], qs[1]}, {ks[0], ks[1], ks[2]}, {vs[0], vs[1], vs[2]}, HQ, KV, HQ / KV, C, P,
              D, DV, page_size, length, lo, scale * LOG2E, out};  // logits in base 2 (softmax_vecs)
    const int64_t units = B * KV * C, rows = HQ / KV / C;
    const int64_t work = B * HQ * P * page_size * (D + DV);
    // a thread costs tens of microseconds to start: only a step of several million multiply-adds is split
    const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, units, work >> 21})));
    run_workers(workers, [&](int w) {
        Scratch s;
        const int64_t RP = (rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
        s.assign(RP, D, BK, DV);
        s.kg.assign(D * BK, 0.0f);
        s.vg.assign(BK * DV, 0.0f);
        for (int64_t u = w; u < units; u += workers) run_unit(a, u, s);
    });
    return 0;
}


// Quest's page choice (attnkit/methods/quest_pages.py: page_bounds, then choose_pages) in one pass over the page
// summaries: per kv head and page the bound sum_d max(q_d m_d, q_d M_d) of each query head of the group, their maximum
// (C = 1) or each head's own (C = HQ / KV); the last page always, the first too with force_first unless a sliding
// window hides slots below visible_from (a page wholly below it is never chosen over a visible one); the `count`
// highest, ascending.
// Summaries mn, mx [B, KV, pages, D] (strides ss: batch, head, page; the last axis contiguous); out [B, KV, C, count].
extern "C" int attnkit_quest_choose(const float* q, const int64_t* qs, const float* mn, const float* mx,
                                    const int64_t* ss, int64_t B, int64_t HQ, int64_t KV, int64_t C, int64_t P,
                                    int64_t D, int64_t count, int64_t visible_from, int64_t page_size,
                                    int64_t force_first, int64_t* out) {
    if (KV <= 0 || HQ % KV || (C != 1 && C != HQ / KV) || count < 1 || count > P) return 1;
    const int64_t G = HQ / KV;
    std::vector<float> score(C * P), bound(G);
    std::vector<int64_t> order(P);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t kh = 0; kh < KV; ++kh) {
            const float* m0 = mn + b * ss[0] + kh * ss[1];
            const float* M0 = mx + b * ss[0] + kh * ss[1];
            for (int64_t p = 0; p < P; ++p) {
                const float *m = m0 + p * ss[2], *M = M0 + p * ss[2];
                for (int64_t r = 0; r < G; ++r) {
                    const float* qr = q + b * qs[0] + (kh * G + r) * qs[1];
                    float total = 0.0f;
                    if (D % VW == 0) {
                        vf acc = splat(0.0f);
                        for (int64_t d = 0; d < D; d += VW) {
                            const vf qv = ld(qr + d);
                            acc += vmax(qv * ld(m + d), qv * ld(M + d));
                        }
                        total = hsum(acc);
                    } else {
                        for (int64_t d = 0; d < D; ++d) total += std::max(qr[d] * m[d], qr[d] * M[d]);
                    }
                    bound[r] = total;
                }
                if (C == 1)
                    score[p] = *std::max_element(bound.begin(), bound.end());
                else
                    for (int64_t c = 0; c < C; ++c) score[c * P + p] = bound[c];
            }
            for (int64_t c = 0; c < C; ++c) {
                float* sc = &score[c * P];
                if (visible_from <= 0) {
                    if (force_first) sc[0] = INFINITY;
                } else {
                    for (int64_t p = 0; p < P && (p + 1) * page_size <= visible_from; ++p) sc[p] = -INFINITY;
                }
                sc[P - 1] = INFINITY;
                std::iota(order.begin(), order.end(), 0);
                std::nth_element(order.begin(), order.begin() + (count - 1), order.end(),
                                 [&](int64_t x, int64_t y) { return sc[x] > sc[y] || (sc[x] == sc[y] && x < y); });
                std::sort(order.begin(), order.begin() + count);
                std::copy(order.begin(), order.begin() + count, out + ((b * KV + kh) * C + c) * count);
            }
        }
    return 0;
}
