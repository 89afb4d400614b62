// One decoding query's attention over chosen pages of its kv head's cache, on a CPU: Quest's step (Tang et al., 2024,
// "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", arXiv 2406.10774), reading only the keys
// and values of those pages.
//
// What and why: see attnkit/methods/quest_native.py. torch can only gather the chosen pages into new tensors and
// then attend over the copy (each chosen entry read, written and read again); here each entry is read once, where
// it lies, by an online softmax (Milakov and Gimelshein, 2018, arXiv 1805.02867) page by page.
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

inline float dot(const float* a, const float* b, int64_t D) {
    if (D % 16 == 0) {
        v16 acc = splat(0.0f);
        for (int64_t d = 0; d < D; d += 16) acc += ld(a + d) * ld(b + d);
        return hsum(acc);
    }
    float acc = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
    return acc;
}

// row r = b * HQ + h: its query over its pages, into out[r]
void run_row(const Problem& a, int64_t r, std::vector<float>& logits, std::vector<float>& acc) {
    const int64_t b = r / a.HQ, h = r % a.HQ, kh = h / a.G, c = a.C == 1 ? 0 : h % a.G;
    const float* q = a.q + b * a.qs[0] + h * a.qs[1];
    const float* K = a.k + b * a.ks[0] + kh * a.ks[1];
    const float* V = a.v + b * a.vs[0] + kh * a.vs[1];
    const int64_t* pages = a.pages + ((b * a.KV + kh) * a.C + c) * a.P;
    std::fill(acc.begin(), acc.end(), 0.0f);
    float M = -INFINITY, L = 0.0f;
    for (int64_t i = 0; i < a.P; ++i) {
        const int64_t j0 = std::max(pages[i] * a.page_size, a.lo);
        const int64_t j1 = std::min((pages[i] + 1) * a.page_size, a.length);
        if (j0 >= j1) continue;
        float top = -INFINITY;
        for (int64_t j = j0; j < j1; ++j) {
            const float l = dot(q, K + j * a.ks[2], a.D) * a.scale;
            logits[j - j0] = l;
            top = std::max(top, l);
        }
        const float m = std::max(M, top);
        const float alpha = M == -INFINITY ? 0.0f : std::exp(M - m);
        L *= alpha;
        for (int64_t d = 0; d < a.DV; ++d) acc[d] *= alpha;
        for (int64_t j = j0; j < j1; ++j) {
            const float p = std::exp(logits[j - j0] - m);
            L += p;
            const float* vj = V + j * a.vs[2];
            if (a.DV % 16 == 0) {
                const v16 pv = splat(p);
                for (int64_t d = 0; d < a.DV; d += 16) st(&acc[d], ld(&acc[d]) + pv * ld(vj + d));
            } else {
                for (int64_t d = 0; d < a.DV; ++d) acc[d] += p * vj[d];
            }
        }
        M = m;
    }
    float* o = a.out + r * a.DV;
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int64_t d = 0; d < a.DV; ++d) o[d] = acc[d] * inv;
}

}  // namespace

extern "C" int attnkit_paged_decode(const float* q, const int64_t* qs, const float* k, const int64_t* ks,
                                    const float* v, const int64_t* vs, const int64_t* pages, int64_t B, int64_t HQ,
                                    int64_t KV, int64_t C, int64_t P, int64_t D, int64_t DV, int64_t page_size,
                                    int64_t length, int64_t lo, float scale, float* out, int threads) {
    if (KV <= 0 || HQ % KV || page_size <= 0 || (C != 1 && C != HQ / KV)) return 1;
    Problem a{q, k, v, pages, {qs[0], qs[1]}, {ks[0], ks[1], ks[2]}, {vs[0], vs[1], vs[2]}, HQ, KV, HQ / KV, C, P,
              D, DV, page_size, length, lo, scale, out};
    const int64_t rows = B * HQ;
    const int64_t work = rows * P * page_size * (D + DV);
    // a thread costs tens of microseconds to start: only a step of several million multiply-adds is split
    const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, rows, work >> 21})));
    run_workers(workers, [&](int w) {
        std::vector<float> logits(page_size), acc(DV);
        for (int64_t r = w; r < rows; r += workers) run_row(a, r, logits, acc);
    });
    return 0;
}
