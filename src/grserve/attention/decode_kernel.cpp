// Decode attention on the staging buffer (attention/decode_kernel.py builds and loads this file).
//
// One query token per request: for request s and KV head h, the GROUP query heads of that KV head attend to the
// request's first lens[s] keys. Scores, softmax and the weighted sum of values accumulate in fp32 whatever the
// input dtype; a bf16 output is rounded once, to nearest even. Each (s, h) is computed on its own, in a fixed
// order, over its own keys only: a request's output does not depend on what else shares the call.
//
// Compiled once per model shape: GROUP (query heads per KV head) and HEAD_DIM (a multiple of 8) are macros, so
// every loop below has constant bounds and the accumulators stay in registers. The vectors are GCC/Clang vector
// extensions of 8 floats: the compiler lowers them to the running CPU's instructions (-march=native).

#include <stdint.h>
#include <string.h>

#include <vector>

#ifndef GROUP
#error "compile with -DGROUP=<query heads per KV head>"
#endif
#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head dim, a multiple of 8>"
#endif

namespace {

constexpr int G = GROUP;
constexpr int D = HEAD_DIM;
constexpr int NV = D / 8;  // 8-float vectors per head row
static_assert(D % 8 == 0, "HEAD_DIM must be a multiple of 8");

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
inline v8 load8(const float* p) { v8 r; memcpy(&r, p, 32); return r; }
inline v8 load8(const uint16_t* p) {  // bf16 → fp32: the 16 bits become the high half
    u16x8 h;
    memcpy(&h, p, 16);
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    v8 r;
    memcpy(&r, &w, 32);
    return r;
}
inline void store8(float* p, v8 x) { memcpy(p, &x, 32); }
inline void store8(uint16_t* p, v8 x) {  // fp32 → bf16, round to nearest even; NaN stays NaN
    u32x8 w;
    memcpy(&w, &x, 32);
    u32x8 r = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
    i8v nan = x != x;
    u32x8 q = (w >> 16) | 0x40u;
    r = nan ? q : r;
    u16x8 h = __builtin_convertvector(r, u16x8);
    memcpy(p, &h, 16);
}

inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// r[i] = the sum of a[i]'s 8 lanes, i < 8 (three rounds of pairwise adds)
inline v8 sum8(const v8* a) {
    const i8v ev = {0, 8, 2, 10, 4, 12, 6, 14}, od = {1, 9, 3, 11, 5, 13, 7, 15};
    v8 b0 = __builtin_shuffle(a[0], a[1], ev) + __builtin_shuffle(a[0], a[1], od);
    v8 b1 = __builtin_shuffle(a[2], a[3], ev) + __builtin_shuffle(a[2], a[3], od);
    v8 b2 = __builtin_shuffle(a[4], a[5], ev) + __builtin_shuffle(a[4], a[5], od);
    v8 b3 = __builtin_shuffle(a[6], a[7], ev) + __builtin_shuffle(a[6], a[7], od);
    const i8v e2 = {0, 1, 8, 9, 4, 5, 12, 13}, o2 = {2, 3, 10, 11, 6, 7, 14, 15};
    v8 c0 = __builtin_shuffle(b0, b1, e2) + __builtin_shuffle(b0, b1, o2);
    v8 c1 = __builtin_shuffle(b2, b3, e2) + __builtin_shuffle(b2, b3, o2);
    const i8v e3 = {0, 1, 2, 3, 8, 9, 10, 11}, o3 = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(c0, c1, e3) + __builtin_shuffle(c0, c1, o3);
}

// exp(x) for x <= 0 (a score minus its row's maximum): 2^n · p(r), r = x − n·ln2, |r| <= ln2/2, a degree-6
// polynomial (about 1 ulp); below −87.33 (and −inf) it is 0, NaN stays NaN
inline v8 exp_nonpositive(v8 x) {
    const v8 lo = splat(-87.33654f);
    i8v under = x < lo;
    v8 xc = under ? lo : x;
    v8 n = __builtin_convertvector(__builtin_convertvector(xc * splat(1.44269504088896341f) - splat(0.5f), i8v), v8);
    v8 r = xc - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    v8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    i8v e = (__builtin_convertvector(n, i8v) + 127) << 23;
    v8 two_n;
    memcpy(&two_n, &e, 32);
    v8 out = p * two_n;
    i8v bits;
    memcpy(&bits, &out, 32);
    bits &= ~under;
    memcpy(&out, &bits, 32);
    return out;
}

// q, o: [S, H, G, D] contiguous; k, v: element (s, h, t, d) at s·ks + h·kh + t·kt + d (unit last stride)
template <typename T>
void attend(const T* q, const T* k, const T* v, T* o, const int64_t* lens, int64_t S, int64_t H, int64_t ks,
            int64_t kh, int64_t kt, int64_t vs, int64_t vh, int64_t vt, float scale, int64_t threads) {
    // one (request, KV head) per iteration: the same arithmetic whichever thread runs it
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < S * H; i++) {
        static thread_local std::vector<float> scratch;
        const int64_t s = i / H, h = i % H;
        const int64_t n = lens[s], n8 = (n + 7) / 8 * 8;
        if (n <= 0) {  // no keys: zeros (the Python side refuses this; never read past the buffer)
            for (int g = 0; g < G; g++)
                for (int j = 0; j < NV; j++) store8(o + (s * H + h) * G * D + g * D + 8 * j, splat(0.f));
            continue;
        }
        if (scratch.size() < (size_t)(G * n8)) scratch.resize(G * n8);
        float* sc = scratch.data();
        {
            const T* qh = q + (s * H + h) * G * D;
            const T* kh_ = k + s * ks + h * kh;
            const T* vh_ = v + s * vs + h * vh;
            T* oh = o + (s * H + h) * G * D;
            v8 qv[G][NV];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < NV; j++) qv[g][j] = load8(qh + g * D + 8 * j) * splat(scale);
            // scores, eight keys at a time (a partial last block reads zeros past n and masks them)
            for (int64_t t = 0; t < n8; t += 8) {
                v8 kr[8][NV];
                for (int i = 0; i < 8; i++)
                    for (int j = 0; j < NV; j++) kr[i][j] = t + i < n ? load8(kh_ + (t + i) * kt + 8 * j) : splat(0.f);
                for (int g = 0; g < G; g++) {
                    v8 a[8];
                    for (int i = 0; i < 8; i++) {
                        a[i] = qv[g][0] * kr[i][0];
                        for (int j = 1; j < NV; j++) a[i] += qv[g][j] * kr[i][j];
                    }
                    store8(sc + g * n8 + t, sum8(a));
                }
            }
            // softmax numerators in place, and their sums
            float total[G];
            for (int g = 0; g < G; g++) {
                float* row = sc + g * n8;
                for (int64_t t = n; t < n8; t++) row[t] = -__builtin_inff();
                v8 mv = load8(row);
                for (int64_t t = 8; t < n8; t += 8) {
                    v8 x = load8(row + t);
                    mv = x > mv ? x : mv;
                }
                float m = mv[0];
                for (int i = 1; i < 8; i++) m = mv[i] > m ? mv[i] : m;
                v8 acc = splat(0.f), mm = splat(m);
                for (int64_t t = 0; t < n8; t += 8) {
                    v8 e = exp_nonpositive(load8(row + t) - mm);
                    store8(row + t, e);
                    acc += e;
                }
                total[g] = hsum(acc);
            }
            // the weighted sum of values
            v8 ov[G][NV];
            for (int g = 0; g < G; g++)
                for (int j = 0; j < NV; j++) ov[g][j] = splat(0.f);
            for (int64_t t = 0; t < n; t++) {
                v8 vr[NV];
                for (int j = 0; j < NV; j++) vr[j] = load8(vh_ + t * vt + 8 * j);
                for (int g = 0; g < G; g++) {
                    v8 p = splat(sc[g * n8 + t]);
                    for (int j = 0; j < NV; j++) ov[g][j] += p * vr[j];
                }
            }
            for (int g = 0; g < G; g++) {
                v8 inv = splat(1.f / total[g]);
                for (int j = 0; j < NV; j++) store8(oh + g * D + 8 * j, ov[g][j] * inv);
            }
        }
    }
}

}  // namespace

extern "C" {

int64_t grserve_decode_attend_group(void) { return G; }
int64_t grserve_decode_attend_head_dim(void) { return D; }

void grserve_decode_attend_f32(const float* q, const float* k, const float* v, float* o, const int64_t* lens,
                               int64_t S, int64_t H, int64_t ks, int64_t kh, int64_t kt, int64_t vs, int64_t vh,
                               int64_t vt, float scale, int64_t threads) {
    attend<float>(q, k, v, o, lens, S, H, ks, kh, kt, vs, vh, vt, scale, threads);
}

void grserve_decode_attend_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o,
                                const int64_t* lens, int64_t S, int64_t H, int64_t ks, int64_t kh, int64_t kt,
                                int64_t vs, int64_t vh, int64_t vt, float scale, int64_t threads) {
    attend<uint16_t>(q, k, v, o, lens, S, H, ks, kh, kt, vs, vh, vt, scale, threads);
}

}  // extern "C"
