// A check of one C++ kernel of attnkit/native against a plain double-precision reference, for builds that Python
// cannot load here: another instruction set's (ARM NEON under qemu-user) or the 128-bit x86 build. Compiled with
// -DKERNEL_SCORING, -DKERNEL_SPARSE or -DKERNEL_PAGED and the kernels' folder on the include path; prints
// "ok <vector width>" or what differs, and exits 1 on a difference (tests/test_native.py runs it).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#if defined(KERNEL_SCORING)
#include "scoring.cpp"
#elif defined(KERNEL_SPARSE)
#include "sparse.cpp"
#else
#include "paged.cpp"
#endif

namespace check {

uint64_t state = 88172645463325252ull;
float uniform() {  // xorshift64 in [-1, 1)
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return static_cast<float>((state >> 40) * (2.0 / 16777216.0) - 1.0);
}
std::vector<float> random(size_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = uniform();
    return x;
}

// softmax(q . k_j * scale over keys j in `seen`) v and the probabilities, for one query row
void attend(const float* q, const float* k, const float* v, int64_t D, int64_t DV, const std::vector<int64_t>& seen,
            double scale, std::vector<double>& out, std::vector<double>& p) {
    double top = -INFINITY;
    p.assign(seen.size(), 0.0);
    for (size_t s = 0; s < seen.size(); ++s) {
        double dot = 0.0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[seen[s] * D + d];
        p[s] = dot * scale;
        top = std::max(top, p[s]);
    }
    double sum = 0.0;
    for (double& x : p) sum += (x = std::exp(x - top));
    out.assign(DV, 0.0);
    for (size_t s = 0; s < seen.size(); ++s) {
        p[s] /= sum;
        for (int64_t e = 0; e < DV; ++e) out[e] += p[s] * v[seen[s] * DV + e];
    }
}

int failures = 0;
void expect(bool ok, const char* what, double got, double want) {
    if (!ok && failures++ < 5) std::printf("%s: %.8g, reference %.8g\n", what, got, want);
}

}  // namespace check

int main() {
    using namespace check;
    const int64_t D = 32, DV = 48, KV = 2, HQ = 6, G = HQ / KV;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<double> ref, p;
#if defined(KERNEL_SCORING)
    // a chunk of NQ queries after a prompt, causal; the output and H2O's statistic (the group's mean, summed)
    const int64_t NQ = 70, NK = 150;
    auto q = random(HQ * NQ * D), k = random(KV * NK * D), v = random(KV * NK * DV);
    const int64_t qs[3] = {HQ * NQ * D, NQ * D, D}, ks[3] = {KV * NK * D, NK * D, D};
    const int64_t vs[3] = {KV * NK * DV, NK * DV, DV};
    std::vector<float> out(HQ * NQ * DV), stats(KV * NK);
    int code = attnkit_prompt_statistics(q.data(), qs, k.data(), ks, v.data(), vs, 1, HQ, KV, NQ, NK, D, DV, scale,
                                         nullptr, 0, nullptr, 0, 0, 16, nullptr, 0, NK, out.data(), stats.data(), 2);
    std::vector<double> want(KV * NK, 0.0);
    for (int64_t h = 0; h < HQ; ++h)
        for (int64_t i = 0; i < NQ; ++i) {
            std::vector<int64_t> seen;
            for (int64_t j = 0; j <= NK - NQ + i; ++j) seen.push_back(j);
            const int64_t kh = h / G;
            attend(&q[(h * NQ + i) * D], &k[kh * NK * D], &v[kh * NK * DV], D, DV, seen, scale, ref, p);
            for (int64_t e = 0; e < DV; ++e)
                expect(std::fabs(out[(h * NQ + i) * DV + e] - ref[e]) < 1e-5, "output", out[(h * NQ + i) * DV + e],
                       ref[e]);
            for (size_t s = 0; s < seen.size(); ++s) want[kh * NK + seen[s]] += p[s] / G;
        }
    for (int64_t j = 0; j < KV * NK; ++j)
        expect(std::fabs(stats[j] - want[j]) <= 1e-5 * want[j] + 1e-6, "statistic", stats[j], want[j]);
    // Keyformer's: each row's probabilities times the bfloat16 factors read from its offset on, renormalised
    const int64_t TLEN = 1000, TILE = attnkit_key_tile(), NKP = (NK + TILE - 1) / TILE * TILE;  // the rows read
    std::vector<uint16_t> table(TLEN);
    std::vector<int64_t> offsets(HQ * NQ);
    auto widen = [](uint16_t h) { uint32_t bits = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &bits, 4); return f; };
    for (uint16_t& t : table) {
        const float f = 0.1f + 3.0f * std::fabs(uniform());
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        t = static_cast<uint16_t>(bits >> 16);
    }
    for (int64_t& o : offsets) o = static_cast<int64_t>((uniform() + 1.0f) * 0.5f * static_cast<float>(TLEN - NKP));
    code |= attnkit_prompt_statistics(q.data(), qs, k.data(), ks, v.data(), vs, 1, HQ, KV, NQ, NK, D, DV, scale,
                                      table.data(), TLEN, offsets.data(), 0, 0, 16, nullptr, 0, NK, out.data(),
                                      stats.data(), 2);
    want.assign(KV * NK, 0.0);
    for (int64_t h = 0; h < HQ; ++h)
        for (int64_t i = 0; i < NQ; ++i) {
            std::vector<int64_t> seen;
            for (int64_t j = 0; j <= NK - NQ + i; ++j) seen.push_back(j);
            attend(&q[(h * NQ + i) * D], &k[h / G * NK * D], &v[h / G * NK * DV], D, DV, seen, scale, ref, p);
            double z = 0.0;
            for (size_t s = 0; s < seen.size(); ++s) z += p[s] * widen(table[offsets[h * NQ + i] + seen[s]]);
            for (size_t s = 0; s < seen.size(); ++s)
                want[h / G * NK + seen[s]] += p[s] * widen(table[offsets[h * NQ + i] + seen[s]]) / z / G;
        }
    for (int64_t j = 0; j < KV * NK; ++j)
        expect(std::fabs(stats[j] - want[j]) <= 1e-5 * want[j] + 1e-6, "Keyformer's statistic", stats[j], want[j]);
#elif defined(KERNEL_SPARSE)
    // every causal tile of 32 (those below the diagonal unmasked): the layout of dense causal attention
    const int64_t NQ = 150, NK = 150, B = 32, T = (NK + B - 1) / B;
    auto q = random(HQ * NQ * D), k = random(KV * NK * D), v = random(KV * NK * DV);
    const int64_t qs[3] = {HQ * NQ * D, NQ * D, D}, ks[3] = {KV * NK * D, NK * D, D};
    const int64_t vs[3] = {KV * NK * DV, NK * DV, DV};
    std::vector<uint8_t> main(HQ * T * T), full(HQ * T * T);
    for (int64_t h = 0; h < HQ; ++h)
        for (int64_t r = 0; r < T; ++r)
            for (int64_t t = 0; t < T; ++t) main[(h * T + r) * T + t] = t <= r, full[(h * T + r) * T + t] = t < r;
    std::vector<int64_t> init(HQ, 1 << 30), local(HQ, 0);
    std::vector<float> out(HQ * NQ * DV);
    int code = attnkit_sparse_attention(q.data(), qs, k.data(), ks, v.data(), vs, HQ, KV, NQ, NK, D, DV, scale, B, 0,
                                        T, T, main.data(), full.data(), init.data(), local.data(), nullptr, 0, nullptr,
                                        nullptr, out.data(), 2);
    for (int64_t h = 0; h < HQ; ++h)
        for (int64_t i = 0; i < NQ; ++i) {
            std::vector<int64_t> seen;
            for (int64_t j = 0; j <= i; ++j) seen.push_back(j);
            attend(&q[(h * NQ + i) * D], &k[h / G * NK * D], &v[h / G * NK * DV], D, DV, seen, scale, ref, p);
            for (int64_t e = 0; e < DV; ++e)
                expect(std::fabs(out[(h * NQ + i) * DV + e] - ref[e]) < 1e-5, "output", out[(h * NQ + i) * DV + e],
                       ref[e]);
        }
#else
    // one query per head over 7 chosen pages of 16 (the last one partial), a kv group sharing them
    const int64_t S = 200, PS = 16, P = 7, length = 197;
    auto q = random(HQ * D), k = random(KV * S * D), v = random(KV * S * DV);
    const int64_t qs[2] = {HQ * D, D}, ks[3] = {KV * S * D, S * D, D}, vs[3] = {KV * S * DV, S * DV, DV};
    std::vector<int64_t> pages = {0, 2, 3, 5, 8, 9, 12, 0, 1, 4, 6, 7, 10, 12};
    std::vector<float> out(HQ * DV);
    int code = attnkit_paged_decode(q.data(), qs, k.data(), ks, v.data(), vs, pages.data(), 1, HQ, KV, 1, P, D, DV,
                                    PS, length, 0, scale, out.data(), 1);
    for (int64_t h = 0; h < HQ; ++h) {
        std::vector<int64_t> seen;
        for (int64_t i = 0; i < P; ++i)
            for (int64_t j = pages[h / G * P + i] * PS; j < std::min((pages[h / G * P + i] + 1) * PS, length); ++j)
                seen.push_back(j);
        attend(&q[h * D], &k[h / G * S * D], &v[h / G * S * DV], D, DV, seen, scale, ref, p);
        for (int64_t e = 0; e < DV; ++e)
            expect(std::fabs(out[h * DV + e] - ref[e]) < 1e-5, "output", out[h * DV + e], ref[e]);
    }
#endif
    if (code != 0) std::printf("the kernel returned %d\n", code);
    if (code != 0 || failures) return 1;
    std::printf("ok %d\n", attnkit_vector_width());
    return 0;
}
