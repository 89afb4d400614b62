// One decoding query's attention over chosen pages of its kv head's cache, on a CPU: Quest's step (Tang et al., 2024,
// "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774), reading only the keys
// and values of those pages.
//
// What and why: see attnkit/methods/quest_native.py. torch can only gather the chosen pages into new tensors and
// then attend over the copy (each chosen entry read, written and read again); here each entry is read once, where
// it lies, by an online softmax (Milakov and Gimelshein, 2018, arXiv 1805.02867) over blocks of 16 keys, each block
// transposed once and read by every query head that chose its page (a kv group shares its pages).
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

// what one worker holds: the unit's queries (scaled), a block of 16 keys transposed, and per query its running
// maximum, sum and output
struct Scratch {
    std::vector<float> q, kt, acc, m, l;
};

// unit u = (b, kv head, choice): the query heads that read one list of pages (the whole group when C = 1, else one
// head), each key block of 16 transposed once and its logits for every query head of the unit formed from it
void run_unit(const Problem& a, int64_t u, Scratch& s) {
    const int64_t b = u / (a.KV * a.C), kh = (u / a.C) % a.KV, c = u % a.C;
    const int64_t rows = a.C == 1 ? a.G : 1, h0 = kh * a.G + (a.C == 1 ? 0 : c);
    const float* K = a.k + b * a.ks[0] + kh * a.ks[1];
    const float* V = a.v + b * a.vs[0] + kh * a.vs[1];
    const int64_t* pages = a.pages + ((b * a.KV + kh) * a.C + c) * a.P;
    for (int64_t r = 0; r < rows; ++r) {
        const float* src = a.q + b * a.qs[0] + (h0 + r) * a.qs[1];
        for (int64_t d = 0; d < a.D; ++d) s.q[r * a.D + d] = src[d] * a.scale;
    }
    std::fill(s.acc.begin(), s.acc.begin() + rows * a.DV, 0.0f);
    std::fill(s.m.begin(), s.m.begin() + rows, -INFINITY);
    std::fill(s.l.begin(), s.l.begin() + rows, 0.0f);
    v16 lane;
    for (int i = 0; i < 16; ++i) lane[i] = static_cast<float>(i);
    for (int64_t i = 0; i < a.P; ++i) {
        const int64_t first = std::max(pages[i] * a.page_size, a.lo);
        const int64_t last = std::min((pages[i] + 1) * a.page_size, a.length);
        for (int64_t j0 = first; j0 < last; j0 += 16) {
            const int64_t n = std::min<int64_t>(16, last - j0);
            for (int64_t j = 0; j < 16; ++j)  // keys j0 .. j0 + n - 1 as columns of kt [D][16], zeros past n
                for (int64_t d = 0; d < a.D; ++d) s.kt[d * 16 + j] = j < n ? K[(j0 + j) * a.ks[2] + d] : 0.0f;
            for (int64_t r = 0; r < rows; ++r) {
                const float* q = &s.q[r * a.D];
                v16 logit = splat(0.0f);
                for (int64_t d = 0; d < a.D; ++d) logit += splat(q[d]) * ld(&s.kt[d * 16]);
                logit = lane < static_cast<float>(n) ? logit : splat(-INFINITY);
                const float top = std::max(s.m[r], hmax(logit));
                const float alpha = s.m[r] == -INFINITY ? 0.0f : std::exp(s.m[r] - top);
                s.m[r] = top;
                const v16 p = vexp(logit - top);
                s.l[r] = s.l[r] * alpha + hsum(p);
                float* acc = &s.acc[r * a.DV];
                if (a.DV % 16 == 0) {
                    for (int64_t e = 0; e < a.DV; e += 16) {
                        v16 o = ld(acc + e) * alpha;
                        for (int64_t j = 0; j < n; ++j) o += splat(p[j]) * ld(V + (j0 + j) * a.vs[2] + e);
                        st(acc + e, o);
                    }
                } else {
                    for (int64_t e = 0; e < a.DV; ++e) {
                        float o = acc[e] * alpha;
                        for (int64_t j = 0; j < n; ++j) o += p[j] * V[(j0 + j) * a.vs[2] + e];
                        acc[e] = o;
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float* o = a.out + (b * a.HQ + h0 + r) * a.DV;
        const float inv = s.l[r] > 0.0f ? 1.0f / s.l[r] : 0.0f;
        for (int64_t e = 0; e < a.DV; ++e) o[e] = s.acc[r * a.DV + e] * inv;
    }
}

}  // namespace

extern "C" int attnkit_paged_decode(const float* q, const int64_t* qs, const float* k, const int64_t* ks,
                                    const float* v, const int64_t* vs, const int64_t* pages, int64_t B, int64_t HQ,
                                    int64_t KV, int64_t C, int64_t P, int64_t D, int64_t DV, int64_t page_size,
                                    int64_t length, int64_t lo, float scale, float* out, int threads) {
    if (KV <= 0 || HQ % KV || page_size <= 0 || (C != 1 && C != HQ / KV)) return 1;
    Problem a{q, k, v, pages, {qs[0], qs[1]}, {ks[0], ks[1], ks[2]}, {vs[0], vs[1], vs[2]}, HQ, KV, HQ / KV, C, P,
              D, DV, page_size, length, lo, scale, out};
    const int64_t units = B * KV * C, rows = HQ / KV / C;
    const int64_t work = B * HQ * P * page_size * (D + DV);
    // a thread costs tens of microseconds to start: only a step of several million multiply-adds is split
    const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, units, work >> 21})));
    run_workers(workers, [&](int w) {
        Scratch s{std::vector<float>(rows * D), std::vector<float>(16 * D), std::vector<float>(rows * DV),
                  std::vector<float>(rows), std::vector<float>(rows)};
        for (int64_t u = w; u < units; u += workers) run_unit(a, u, s);
    });
    return 0;
}


// Quest's page choice (attnkit/methods/quest_pages.py: page_bounds, then choose_pages) in one pass over the page
// summaries: per kv head and page the bound sum_d max(q_d m_d, q_d M_d) of each query head of the group, their maximum
// (C = 1) or each head's own (C = HQ / KV); the last page always, the first too unless a sliding window hides slots
// below visible_from (a page wholly below it is never chosen over a visible one); the `count` highest, ascending.
// Summaries mn, mx [B, KV, pages, D] (strides ss: batch, head, page; the last axis contiguous); out [B, KV, C, count].
extern "C" int attnkit_quest_choose(const float* q, const int64_t* qs, const float* mn, const float* mx,
                                    const int64_t* ss, int64_t B, int64_t HQ, int64_t KV, int64_t C, int64_t P,
                                    int64_t D, int64_t count, int64_t visible_from, int64_t page_size, int64_t* out) {
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
                    if (D % 16 == 0) {
                        v16 acc = splat(0.0f);
                        for (int64_t d = 0; d < D; d += 16) {
                            const v16 qv = ld(qr + d);
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
                    sc[0] = INFINITY;
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
