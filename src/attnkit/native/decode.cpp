// One decoding query per row and query head over the entries its kv head holds, wherever they lie, with the logits
// and probabilities a per-step eviction method scores by (H2O, arXiv 2306.14048; TOVA, arXiv 2401.06104), and
// optionally Keyformer's score (arXiv 2403.09054, eq. 9), on a CPU.
//
// What and why: see attnkit/methods/decode_native.py. In short, a per-step method needs each step's attention
// probabilities over the held entries, which no attention kernel returns, so it computes the step's attention
// itself; in vLLM's paged cache torch must first copy every held entry out of its block. Here each entry is read
// once from where it lies: the keys into a tile of 64 (transposed) that stays in the worker's caches, or swept in
// their blocks where they lie transposed; the value rows where they lie, by the output's sweep. Every query head of
// the kv group is swept with the prompt kernels' micro-tiles (tile.h).
//
// Addressing: entry j of row r and kv head h starts at element koff[(r * KV + h) * N + j] of `key` (voff of
// `value`), or, without offsets, at r * ks[0] + h * ks[1] + j * ks[2] (a strided tensor [R, KV, N, D]); its numbers
// lie ks[3] (vs[3]) elements apart: a strided tensor and vLLM's blocks (rows, or each block's keys transposed)
// alike. The arithmetic never depends on where an entry lies, so a cache read in place and a copy of it give the
// same bits. Queries q [R, HQ, D] (qs: row and head strides, the last axis contiguous); outputs out [R, HQ, DV],
// logits and probs [R, HQ, N] (contiguous; logits already scaled; either null where the caller needs neither).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "tile.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using namespace attnkit;

typedef float v4u __attribute__((vector_size(16), aligned(4)));  // four floats at any float's address

struct Problem {
    const float *q, *key, *value;
    const int64_t *koff, *voff;
    int64_t qs[2], ks[3], vs[3], kstep, vstep;  // ks/vs: a strided tensor's row, head and entry strides
    int64_t HQ, KV, G, GP, N, NP, D, DV;
    float scale;
    float *out, *logits, *probs;
    // Keyformer's score (eq. 9), where `weights` is given: per row and query head, softmax((logit + zeta) / tau) with
    // zeta = table[noise_off[r, head] + kpos[r, h, j]] (or `shift` where the table is null and `counters` too),
    // reduced over the group (mean or max) into weights [R, KV, N]. With `counters` (the Gumbel table's row hash, key
    // salt and two multipliers), the table's entries are computed where they are needed instead of read: gumbel_at
    const float *table, *tau;
    const int64_t *noise_off, *kpos;
    bool hashed;
    uint32_t row, salt, m1, m2;
    float shift;
    bool group_max;
    float* weights;
};

struct Scratch {
    std::vector<float> q, kt, vt, s, l, o, alpha;  // queries, a tile's keys and values, logits, all logits, outputs
    std::vector<int64_t> at, bases, where;          // where a tile's keys start; block_logits' blocks, slots
    std::vector<float> slots;                       // block_logits' logits of every slot of those blocks
    std::vector<float> y;                           // Keyformer's noisy logits of one query head
    std::vector<uint32_t> kp;                       // its keys' positions as 32-bit counters
    std::vector<const float*> vrow;                 // where a tile's value rows lie
};

typedef uint32_t vuu __attribute__((vector_size(4 * VW), aligned(4)));  // the same, at any counter's address

// Entries t of the Gumbel draw table, computed: -log(-log(u)), u from t's counter hash, the arithmetic of
// attnkit/methods/keyformer_noise.py (key_hashes, uniforms_from_hashes; its integers bit for bit, its logarithms by
// vlog, within about a float's last bit of torch's). Each draw costs a few vector operations where reading it costs
// a cache miss: a step's rows start at new random offsets of a table of millions of entries.
inline vf gumbel_at(const Problem& a, vu t) {
    vu k = t ^ a.salt;  // key_hashes: MurmurHash3's finaliser
    k ^= k >> 16;
    k *= a.m1;
    k ^= k >> 13;
    k *= a.m2;
    k ^= k >> 16;
    vu x = (k ^ a.row) * a.m1;  // uniforms_from_hashes
    x ^= x >> 16;
    x *= a.m2;
    x = (x >> 9) | 0x3F800000u;
    const vf u = (vf)x - (1.0f - 0x1p-24f);
    return -vlog(-vlog(u));
}

// where entry j of row r and kv head h starts: off[j] (that row and head's offsets), or by the strides
inline int64_t start(const int64_t* off, const int64_t* strides, int64_t r, int64_t h, int64_t j) {
    return off ? off[j] : r * strides[0] + h * strides[1] + j * strides[2];
}

// the n keys of a tile (from entry j0) of one kv head into kt [D, BK] (zero past n): each key's numbers where they lie
void load_keys(const Problem& a, Scratch& s, int64_t item, int64_t j0, int64_t n) {
    const int64_t r = item / a.KV, h = item % a.KV, D = a.D;
    const int64_t* off = a.koff ? a.koff + item * a.N : nullptr;
    float* kt = s.kt.data();
    int64_t* at = s.at.data();
    for (int64_t c = 0; c < n; ++c) at[c] = start(off, a.ks, r, h, j0 + c);
    if (a.kstep == 1) {  // each key a row: four keys' four numbers at a time, turned in registers
        int64_t c = 0;
        for (; D % 4 == 0 && c + 4 <= n; c += 4)
            for (int64_t d = 0; d < D; d += 4) {
                const v4 r0 = *reinterpret_cast<const v4u*>(a.key + at[c] + d);
                const v4 r1 = *reinterpret_cast<const v4u*>(a.key + at[c + 1] + d);
                const v4 r2 = *reinterpret_cast<const v4u*>(a.key + at[c + 2] + d);
                const v4 r3 = *reinterpret_cast<const v4u*>(a.key + at[c + 3] + d);
                for (int i = 0; i < 4; ++i)  // built lane by lane: compilers turn this into shuffles
                    *reinterpret_cast<v4u*>(kt + (d + i) * BK + c) = v4{r0[i], r1[i], r2[i], r3[i]};
            }
        for (; c < n; ++c)
            for (int64_t d = 0; d < D; ++d) kt[d * BK + c] = a.key[at[c] + d];
    } else {  // each number a step apart (vLLM's CPU keys: a block's keys transposed): runs of adjacent keys copied
        for (int64_t c = 0; c < n;) {
            int64_t e = c + 1;
            while (e < n && at[e] == at[e - 1] + 1) ++e;
            for (int64_t d = 0; d < D; ++d) {
                const float* src = a.key + at[c] + d * a.kstep;
                float* dst = kt + d * BK;
                for (int64_t i = c; i < e; ++i) dst[i] = src[i - c];
            }
            c = e;
        }
    }
    for (int64_t d = 0; d < D; ++d) std::fill(kt + d * BK + n, kt + (d + 1) * BK, 0.0f);
}

// the n values of a tile as rows of DV numbers: where they lie (a strided tensor's, row stride *stride), or copied
// into vt (numbers a step apart)
const float* load_values(const Problem& a, Scratch& s, int64_t item, int64_t j0, int64_t n, int64_t* stride) {
    const int64_t r = item / a.KV, h = item % a.KV;
    if (!a.voff && a.vstep == 1) {
        *stride = a.vs[2];
        return a.value + start(nullptr, a.vs, r, h, j0);
    }
    *stride = a.DV;
    for (int64_t c = 0; c < n; ++c) {
        float* dst = s.vt.data() + c * a.DV;
        const float* src = a.value + start(a.voff ? a.voff + item * a.N : nullptr, a.vs, r, h, j0 + c);
        for (int64_t e = 0; e < a.DV; ++e) dst[e] = src[e * a.vstep];
    }
    return s.vt.data();
}

// The logits of every entry where the keys lie in blocks whose numbers are kstep apart (vLLM's CPU keys: a block's
// keys transposed, [D, block size]): every slot of each block an entry lies in, swept as a tile where it lies, then
// each entry's own picked. A lane's arithmetic is the same whichever key it holds, so these are the bits of the tiles
// load_keys builds; they skip its scattered reads where the entries fill most of their blocks. False where they do
// not (or the blocks are not whole tiles): the caller builds the tiles.
bool block_logits(const Problem& a, Scratch& s, int64_t item, const float* Q) {
    const int64_t K = a.kstep, D = a.D, GP = a.GP, NP = a.NP;
    if (!a.koff || K == 1 || K % BK) return false;
    const int64_t* off = a.koff + item * a.N;
    std::vector<int64_t>& bases = s.bases;  // the blocks, in the order first met (a few: a linear search)
    bases.clear();
    s.where.resize(a.N);
    const int64_t mask = (K & (K - 1)) == 0 ? K - 1 : -1;  // a block size that is a power of two: no division
    for (int64_t j = 0, last = -1; j < a.N; ++j) {
        const int64_t within = mask >= 0 ? off[j] & mask : off[j] % K;
        const int64_t base = off[j] - within;
        if (last < 0 || bases[last] != base) {
            last = std::find(bases.begin(), bases.end(), base) - bases.begin();
            if (last == static_cast<int64_t>(bases.size())) {
                if (static_cast<int64_t>(bases.size() + 1) * K > 2 * NP) return false;
                bases.push_back(base);
            }
        }
        s.where[j] = last * K + within;
    }
    const int64_t W = static_cast<int64_t>(bases.size()) * K;  // slot logits per query row
    s.slots.resize(GP * W);
    float *SL = s.slots.data(), *S = s.s.data(), *L = s.l.data();
    for (size_t i = 0; i < bases.size(); ++i)
        for (int64_t c0 = 0; c0 < K; c0 += BK)
            for (int64_t g = 0; g < GP; g += QK_ROWS) {
                qk_tile(Q + g * D, D, a.key + bases[i] + c0, K, S);
                for (int rr = 0; rr < QK_ROWS; ++rr)
                    std::memcpy(SL + (g + rr) * W + i * K + c0, S + rr * BK, BK * sizeof(float));
            }
    for (int64_t g = 0; g < GP; ++g)
        for (int64_t j = 0; j < a.N; ++j) L[g * NP + j] = SL[g * W + s.where[j]];
    for (int64_t g = 0; g < GP; ++g) std::fill(L + g * NP + a.N, L + (g + 1) * NP, -INFINITY);
    return true;
}

// Keyformer's score of item (r, h) from its logits (L: a row of NP per query head, -inf past the last entry): eq. 9
// per query head, reduced over the group
void keyformer_weights(const Problem& a, Scratch& s, int64_t item, const float* L) {
    const int64_t r = item / a.KV, h = item % a.KV, G = a.G, N = a.N, NP = a.NP;
    const int64_t* kpos = a.kpos + item * N;
    float *Y = s.y.data(), *W = s.y.data() + NP;  // the noisy logits of a query head; the group's sum or maximum
    float* w = a.weights + item * N;
    const float tau = a.tau[r];
    if (a.hashed)  // the positions as counters, once for the group (past N: any, their logits are -inf)
        for (int64_t j = 0; j < NP; ++j) s.kp[j] = j < N ? static_cast<uint32_t>(kpos[j]) : 0u;
    for (int64_t g = 0; g < G; ++g) {
        const int64_t head = h * G + g;
        const float* logit = L + g * NP;
        if (a.hashed) {
            const uint32_t off = static_cast<uint32_t>(a.noise_off[r * a.HQ + head]);
            for (int64_t j = 0; j < NP; j += VW)
                st(Y + j, ld(logit + j) + gumbel_at(a, *reinterpret_cast<const vuu*>(s.kp.data() + j) + off));
        } else if (a.table) {
            const float* zeta = a.table + a.noise_off[r * a.HQ + head];
            for (int64_t j = 0; j < N; ++j) Y[j] = logit[j] + zeta[kpos[j]];
        } else {
            for (int64_t j = 0; j < N; ++j) Y[j] = logit[j] + a.shift;
        }
        std::fill(Y + N, Y + NP, -INFINITY);
        vf top = splat(-INFINITY);
        for (int64_t c = 0; c < NP; c += VW) {
            st(Y + c, ld(Y + c) / splat(tau));
            top = vmax(top, ld(Y + c));
        }
        const float m = hmax(top);
        vf sum = splat(0.0f);
        for (int64_t c = 0; c < NP; c += VW) {
            const vf e = vexp(ld(Y + c) - m);
            sum += e;
            st(Y + c, e);
        }
        const vf total = splat(hsum(sum));
        for (int64_t c = 0; c < NP; c += VW) {
            const vf p = ld(Y + c) / total;
            st(W + c, g == 0 ? p : a.group_max ? vmax(ld(W + c), p) : ld(W + c) + p);
        }
    }
    const int64_t tail = N / VW * VW;  // whole vectors written in place; the rest through the scratch row
    const vf groups = splat(static_cast<float>(G));
    for (int64_t c = 0; c < tail; c += VW) st(w + c, a.group_max ? ld(W + c) : ld(W + c) / groups);
    for (int64_t j = tail; j < N; ++j) w[j] = a.group_max ? W[j] : W[j] / static_cast<float>(G);
}

// kv head h of row r: every query head of its group (GP rows, padded with zero queries)
void run_item(const Problem& a, Scratch& s, int64_t item) {
    const int64_t r = item / a.KV, h = item % a.KV, G = a.G, GP = a.GP, D = a.D, DV = a.DV, NP = a.NP;
    float *Q = s.q.data(), *L = s.l.data(), *S = s.s.data(), *O = s.o.data();
    for (int64_t g = 0; g < GP; ++g)
        for (int64_t d = 0; d < D; ++d)
            Q[g * D + d] = g < G ? a.q[r * a.qs[0] + (h * G + g) * a.qs[1] + d] * a.scale : 0.0f;
    // the logits, tile by tile
    for (int64_t j0 = block_logits(a, s, item, Q) ? a.N : 0; j0 < a.N; j0 += BK) {
        const int64_t n = std::min(BK, a.N - j0);
        load_keys(a, s, item, j0, n);
        for (int64_t g = 0; g < GP; g += QK_ROWS) {
            qk_tile(Q + g * D, D, s.kt.data(), BK, S);
            for (int rr = 0; rr < QK_ROWS; ++rr) {
                float* dst = L + (g + rr) * NP + j0;
                for (int c = 0; c < TV; ++c) st(dst + c * VW, ld(S + rr * BK + c * VW));
                std::fill(dst + n, dst + BK, -INFINITY);  // past the last entry (the last tile's padding)
            }
        }
    }
    if (a.weights) keyformer_weights(a, s, item, L);
    // the probabilities: exponentials relative to each row's maximum, divided by their sum
    for (int64_t g = 0; g < G; ++g) {
        float* row = L + g * NP;
        vf top = splat(-INFINITY);
        for (int64_t c = 0; c < NP; c += VW) top = vmax(top, ld(row + c));
        const float m = hmax(top);
        if (a.logits) std::memcpy(a.logits + (r * a.HQ + h * G + g) * a.N, row, a.N * sizeof(float));
        vf sum = splat(0.0f);
        for (int64_t c = 0; c < NP; c += VW) {
            const vf e = vexp(ld(row + c) - m);
            sum += e;
            st(row + c, e);
        }
        const float total = hsum(sum);
        for (int64_t c = 0; c < NP; c += VW) st(row + c, ld(row + c) / total);
        if (a.probs) std::memcpy(a.probs + (r * a.HQ + h * G + g) * a.N, row, a.N * sizeof(float));
    }
    for (int64_t g = G; g < GP; ++g) std::fill(L + g * NP, L + (g + 1) * NP, 0.0f);
    // the output: the probabilities times the values, tile by tile
    std::fill(O, O + GP * DV, 0.0f);
    for (int64_t j0 = 0; j0 < a.N; j0 += BK) {
        const int64_t n = std::min(BK, a.N - j0);
        if (a.voff && a.vstep == 1) {  // rows of adjacent numbers (vLLM's value blocks): read where they lie, not
            const int64_t* off = a.voff + item * a.N + j0;  // copied into a tile first (written and read once more)
            for (int64_t c = 0; c < n; ++c) s.vrow[c] = a.value + off[c];
            for (int64_t g = 0; g < GP; g += QK_ROWS)
                pv_rows<QK_ROWS>(L + g * NP + j0, NP, ScatteredRows{s.vrow.data()}, n, O + g * DV, DV, s.alpha.data());
            continue;
        }
        int64_t ldv;
        const float* V = load_values(a, s, item, j0, n, &ldv);
        for (int64_t g = 0; g < GP; g += QK_ROWS)
            pv_rows<QK_ROWS>(L + g * NP + j0, NP, V, ldv, n, O + g * DV, DV, s.alpha.data());
    }
    for (int64_t g = 0; g < G; ++g) std::memcpy(a.out + (r * a.HQ + h * G + g) * DV, O + g * DV, DV * sizeof(float));
}

}  // namespace

// Returns 0, or 1 for shapes the kernel does not take (value heads not a multiple of 16 wide), 3 when its buffers
// cannot be allocated.
extern "C" int attnkit_decode_attention(const float* q, const int64_t* qs, int64_t R, int64_t HQ, int64_t KV,
                                        int64_t N, int64_t D, int64_t DV, const float* key, const int64_t* koff,
                                        const int64_t* ks, const float* value, const int64_t* voff,
                                        const int64_t* vs, float scale, float* out, float* logits, float* probs,
                                        const float* table, const int64_t* counters, const int64_t* noise_off,
                                        const int64_t* kpos,
                                        const float* tau, float shift, int group_max, float* weights, int threads) {
    if (R < 1 || KV < 1 || HQ % KV || N < 1 || D < 1 || DV < 16 || DV % 16) return 1;
    Problem a;
    a.q = q, a.key = key, a.value = value, a.koff = koff, a.voff = voff;
    a.qs[0] = qs[0], a.qs[1] = qs[1], a.kstep = ks[3], a.vstep = vs[3];
    for (int i = 0; i < 3; ++i) a.ks[i] = ks[i], a.vs[i] = vs[i];
    a.HQ = HQ, a.KV = KV, a.G = HQ / KV, a.GP = (a.G + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
    a.N = N, a.NP = (N + BK - 1) / BK * BK, a.D = D, a.DV = DV, a.scale = scale;
    a.out = out, a.logits = logits, a.probs = probs;
    a.table = table, a.noise_off = noise_off, a.kpos = kpos, a.tau = tau, a.shift = shift;
    a.hashed = counters != nullptr;
    if (a.hashed)
        a.row = static_cast<uint32_t>(counters[0]), a.salt = static_cast<uint32_t>(counters[1]),
        a.m1 = static_cast<uint32_t>(counters[2]), a.m2 = static_cast<uint32_t>(counters[3]);
    a.group_max = group_max != 0, a.weights = weights;
    if (weights && (!kpos || !tau || ((table || counters) && !noise_off))) return 1;
    const int64_t work = R * KV;
#ifdef _OPENMP
    const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, work)));
#else
    const int workers = 1;
#endif
    std::vector<Scratch> scratch(workers);
    try {
        for (Scratch& s : scratch) {
            s.q.assign(a.GP * D, 0.0f);
            s.kt.assign(D * BK, 0.0f);
            s.vt.assign(BK * DV, 0.0f);
            s.vrow.assign(BK, nullptr);
            s.s.assign(QK_ROWS * BK, 0.0f);
            s.l.assign(a.GP * a.NP, 0.0f);
            s.o.assign(a.GP * DV, 0.0f);
            s.alpha.assign(QK_ROWS, 1.0f);
            s.at.assign(BK, 0);
            s.y.assign(weights ? 2 * a.NP : 0, 0.0f);
            s.kp.assign(a.hashed ? a.NP : 0, 0u);
        }
    } catch (const std::bad_alloc&) {
        return 3;
    }
    // item n (a row's kv head) goes to worker n % workers, in the OpenMP threads torch itself runs on (a pool whose
    // threads wait, where threads started per call cost more than a small step); each item's arithmetic is its own,
    // so the results do not depend on the thread count
#ifdef _OPENMP
#pragma omp parallel for num_threads(workers) schedule(static, 1)
#endif
    for (int64_t n = 0; n < work; ++n) {
#ifdef _OPENMP
        run_item(a, scratch[omp_get_thread_num()], n);
#else
        run_item(a, scratch[0], n);
#endif
    }
    return 0;
}

// Per row and kv head, the slot of the lowest-ranked entry that is not protected (a per-step method's victim,
// attnkit/methods/scoring.py lowest): rank [R, KV, N] float32 and protect [R, KV, N] (nonzero: protected; null:
// none) at any strides in elements, into out [R, KV] (int64). torch's argmin over the rank with protected entries at
// +inf, where torch's three operations on a few thousand numbers cost more than their arithmetic: the first least
// value, the first NaN where there is one, and 0 where every value is +inf (every entry protected included). Rows
// whose numbers are adjacent go a vector at a time, each lane keeping its least value and where it first met it.
typedef uint8_t vbu __attribute__((vector_size(VW), aligned(1)));

extern "C" void attnkit_lowest(const float* rank, const int64_t* rs, const uint8_t* protect, const int64_t* ps,
                               int64_t R, int64_t KV, int64_t N, int64_t* out) {
    const bool adjacent = rs[2] == 1 && (!protect || ps[2] == 1) && N < (int64_t{1} << 30);
    constexpr int32_t NONE = INT32_MAX;
    for (int64_t r = 0; r < R; ++r)
        for (int64_t h = 0; h < KV; ++h) {
            const float* x = rank + r * rs[0] + h * rs[1];
            const uint8_t* p = protect ? protect + r * ps[0] + h * ps[1] : nullptr;
            float least = INFINITY;
            int64_t at = 0, first_nan = -1, j = 0;
            if (adjacent) {
                vf lo = splat(INFINITY);
                vi where = {}, nan = {}, index = {};
                for (int i = 0; i < VW; ++i) index[i] = i, nan[i] = NONE;
                for (; j + VW <= N; j += VW, index += VW) {
                    vf v = ld(x + j);
                    const vi hidden = p ? __builtin_convertvector(*reinterpret_cast<const vbu*>(p + j), vi) : vi{};
                    v = hidden != 0 ? splat(INFINITY) : v;
                    nan = v != v && nan == NONE ? index : nan;
                    const vi less = v < lo;
                    lo = less ? v : lo;
                    where = less ? index : where;
                }
                for (int i = 0; i < VW; ++i) {
                    if (nan[i] != NONE && (first_nan < 0 || nan[i] < first_nan)) first_nan = nan[i];
                    if (lo[i] < least || (lo[i] == least && where[i] < at)) least = lo[i], at = where[i];
                }
            }
            for (; j < N && first_nan < 0; ++j) {
                const float v = p && p[j * ps[2]] ? INFINITY : x[j * rs[2]];
                if (v != v) first_nan = j;
                if (v < least) least = v, at = j;
            }
            out[r * KV + h] = first_nan >= 0 ? first_nan : least == INFINITY ? 0 : at;
        }
}
