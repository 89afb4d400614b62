// MInference's sparse prefill on a CPU: the layout's tiles of one query head, one sweep with FlashAttention's online
// softmax, tiles outside the layout never computed.
//
// What and why: see attnkit/sparse/kernels.py. The layout (attnkit/sparse/layout.py; MInference 1.0, Jiang et al.,
// 2024, arXiv 2407.02490, Alg. 4-5) names per query head and query tile row the key tiles computed ("main" tiles;
// those on main_full need no mask) and, for vertical-slash heads, tiles of gathered vertical columns ("vert"; those
// on vert_full need no mask). Inside a masked main tile the token rule holds: causal, and j < init or i - j < local
// or j in key tile 0 or j in the query's own tile. A gathered column c counts for query i when c lies in a tile
// before i's own and that tile is not a main tile of i's row (never counted twice).
//
// Layout: q [1, HQ, NQ, D], k [1, KV, NK, D], v [1, KV, NK, DV], float32, the last axis contiguous, strides in
// elements (qs/ks/vs: batch, head, position). The queries are the last NQ of NK positions. main/main_full [HQ, rows,
// tiles] and vert/vert_full [HQ, rows, width / block] (bytes, 0 or 1), init/local [HQ], columns [HQ, width] (int64,
// ascending, past NK where padding); the rows start at query tile first_row. Output: out [1, HQ, NQ, DV].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "tile.h"

namespace {

using namespace attnkit;

struct Layout {
    const float *q, *k, *v;
    int64_t qs[3], ks[3], vs[3];
    int64_t HQ, G, NQ, NK, D, DV, block, first_row, rows, tiles, width;
    float scale;
    const uint8_t *main, *main_full, *vert, *vert_full;
    const int64_t *init, *local, *columns;
    float* out;
    const float* kt;  // the keys transposed, [KV, key tiles, D, BK]: tile t holds keys t * block .. in its
    int64_t key_tiles;  // first `block` lanes, zeros elsewhere
};

struct Scratch : RowBuffers {
    std::vector<float> kg, vg;  // a tile of gathered columns: keys transposed, values
    std::vector<char> real;     // whether row u is a query
};

// the logits of the block's rows against one tile (64 lanes, `Kt` transposed, [D, BK]; lanes from `keys`
// on are hidden, and rows that are no query), hidden also where `allowed(row, lane)` is false unless the tile needs
// no mask (`full`), into the rows' online softmax; then the output update from the tile's values
template <typename Allowed>
void sweep_tile(const Layout& a, Scratch& s, const float* Kt, const float* V, int64_t ldv, int64_t keys,
                bool full, Allowed allowed) {
    const int64_t RP = (a.block + PAD - 1) / PAD * PAD;
    float *P = s.p.data(), *M = s.m.data(), *L = s.l.data(), *AL = s.alpha.data(), *S = s.s.data();
    for (int64_t r = 0; r < RP; r += QK_ROWS) {
        qk_tile(s.q.data() + r * a.D, a.D, Kt, BK, S);
        for (int rr = 0; rr < QK_ROWS; ++rr) {
            const int64_t row = r + rr;
            float* logits = S + rr * BK;
            if (s.real[row] && !full)
                for (int64_t lane = 0; lane < keys; ++lane)
                    if (!allowed(row, lane)) logits[lane] = -INFINITY;
            AL[row] = softmax_tile(logits, s.real[row] ? keys : 0, M[row], L[row], P + row * BK);
        }
    }
    for (int64_t r = 0; r < RP; r += PAD)
        pv_rows<PAD>(P + r * BK, BK, V, ldv, keys, s.o.data() + r * a.DV, a.DV, AL + r);
}

// query tile row `r` of query head h
void run_row(const Layout& a, Scratch& s, int64_t h, int64_t r) {
    const int64_t B = a.block, D = a.D, DV = a.DV, kh = h / a.G, start = a.NK - a.NQ;
    const int64_t q0 = (a.first_row + r) * B;  // position of the row's first query
    const int64_t R = B, RP = (R + PAD - 1) / PAD * PAD;
    for (int64_t u = 0; u < RP; ++u) {  // row u: the query at position q0 + u, when it is one of the NQ
        float* dst = s.q.data() + u * D;
        const int64_t pos = q0 + u;
        if (u < R && pos >= start && pos < a.NK) {
            const float* src = a.q + h * a.qs[1] + (pos - start) * a.qs[2];
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
        } else {
            std::memset(dst, 0, D * sizeof(float));
        }
    }
    std::fill(s.o.begin(), s.o.begin() + RP * DV, 0.0f);
    std::fill(s.l.begin(), s.l.begin() + RP, 0.0f);
    std::fill(s.m.begin(), s.m.begin() + RP, -INFINITY);
    for (int64_t u = 0; u < RP; ++u) s.real[u] = u < R && q0 + u >= start && q0 + u < a.NK;
    const uint8_t* main = a.main + (h * a.rows + r) * a.tiles;
    const uint8_t* main_full = a.main_full + (h * a.rows + r) * a.tiles;
    const int64_t init = a.init[h], local = a.local[h];
    const float* Kt = a.kt + kh * a.key_tiles * D * BK;
    const float* V = a.v + kh * a.vs[1];
    for (int64_t t = 0; t < a.tiles; ++t) {
        if (!main[t]) continue;
        const int64_t j0 = t * B, keys = std::min(B, a.NK - j0);
        sweep_tile(a, s, Kt + t * D * BK, V + j0 * a.vs[2], a.vs[2], keys, main_full[t], [&](int64_t u, int64_t lane) {
            const int64_t i = q0 + u, j = j0 + lane;
            return j <= i && (j < init || i - j < local || j < B || j / B == i / B);
        });
    }
    if (a.columns) {
        const uint8_t* vert = a.vert + (h * a.rows + r) * (a.width / B);
        const uint8_t* vert_full = a.vert_full + (h * a.rows + r) * (a.width / B);
        const int64_t* cols = a.columns + h * a.width;
        float *Kg = s.kg.data(), *Vg = s.vg.data();
        for (int64_t c = 0; c < a.width / B; ++c) {
            if (!vert[c]) continue;
            const int64_t* tile_cols = cols + c * B;
            std::fill(s.kg.begin(), s.kg.end(), 0.0f);
            for (int64_t lane = 0; lane < B; ++lane) {  // the tile's columns gathered: keys transposed, values
                const int64_t col = tile_cols[lane];
                if (col < 0 || col >= a.NK) {
                    std::memset(Vg + lane * DV, 0, DV * sizeof(float));
                    continue;
                }
                const float* kp = a.k + kh * a.ks[1] + col * a.ks[2];
                for (int64_t d = 0; d < D; ++d) Kg[d * BK + lane] = kp[d];
                std::memcpy(Vg + lane * DV, V + col * a.vs[2], DV * sizeof(float));
            }
            sweep_tile(a, s, Kg, Vg, DV, B, vert_full[c], [&](int64_t u, int64_t lane) {
                const int64_t col = tile_cols[lane];
                return col >= 0 && col < a.NK && col < (q0 + u) / B * B && !main[col / B];
            });
        }
    }
    for (int64_t u = 0; u < R; ++u) {
        if (!s.real[u]) continue;
        float* dst = a.out + (h * a.NQ + q0 + u - start) * DV;
        const float inv = s.l[u] > 0.0f ? 1.0f / s.l[u] : 0.0f;  // a head with no tiles (sent to dense attention)
        for (int64_t d = 0; d < DV; ++d) dst[d] = s.o[u * DV + d] * inv;
    }
}

}  // namespace

// Returns 0, or 1 for shapes the kernel does not take, 3 when its buffers cannot be allocated.
extern "C" int attnkit_sparse_attention(const float* q, const int64_t* qs, const float* k, const int64_t* ks,
                                        const float* v, const int64_t* vs, int64_t HQ, int64_t KV, int64_t NQ,
                                        int64_t NK, int64_t D, int64_t DV, float scale, int64_t block,
                                        int64_t first_row, int64_t rows, int64_t tiles, const uint8_t* main,
                                        const uint8_t* main_full, const int64_t* init, const int64_t* local,
                                        const int64_t* columns, int64_t width, const uint8_t* vert,
                                        const uint8_t* vert_full, float* out, int threads) {
    if (KV < 1 || HQ % KV || NQ < 1 || NQ > NK || D < 1 || DV < 16 || DV % 16 || block < 16 || block > BK ||
        block % 16 || (columns && width % block) || first_row * block > NK - NQ || (first_row + rows) * block < NK)
        return 1;
    Layout a;
    a.q = q, a.k = k, a.v = v;
    for (int i = 0; i < 3; ++i) a.qs[i] = qs[i], a.ks[i] = ks[i], a.vs[i] = vs[i];
    a.HQ = HQ, a.G = HQ / KV, a.NQ = NQ, a.NK = NK, a.D = D, a.DV = DV, a.block = block;
    a.first_row = first_row, a.rows = rows, a.tiles = tiles, a.width = columns ? width : 0;
    a.scale = scale * LOG2E;  // logits in base 2 (softmax_vecs)
    a.main = main, a.main_full = main_full, a.vert = vert, a.vert_full = vert_full;
    a.init = init, a.local = local, a.columns = columns, a.out = out;
    a.key_tiles = (NK + block - 1) / block;
    const int64_t work = HQ * rows, RP = (block + PAD - 1) / PAD * PAD;
    const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, work)));
    std::vector<float> kt;
    std::vector<Scratch> scratch(workers);
    try {
        kt.assign(static_cast<size_t>(KV * a.key_tiles * D * BK), 0.0f);
        for (Scratch& s : scratch) {
            s.assign(RP, D, BK, DV);
            s.kg.assign(D * BK, 0.0f);
            s.vg.assign(BK * DV, 0.0f);
            s.real.assign(RP, 0);
        }
    } catch (const std::bad_alloc&) {
        return 3;
    }
    transpose_keys(k, ks, 1, KV, NK, D, block, kt.data());
    a.kt = kt.data();
    auto run = [&](int w) {  // rows from the last (the longest) down, every worker taking every workers-th
        for (int64_t n = w; n < work; n += workers) run_row(a, scratch[w], n % HQ, rows - 1 - n / HQ);
    };
    run_workers(workers, run);
    return 0;
}
