/*
 * SHA-256 (FIPS 180-4), written from the standard, and the saved file's checksum: a hash list
 * over 8 MiB chunks, so that the chunks are hashed on several threads (nimble_sha256.h); the
 * threads' spreading lives here, where the loader (nimble.c) takes it too, so that this file
 * still builds alone, without libcuda.
 */
#define _POSIX_C_SOURCE 200809L
#include "nimble_sha256.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NIMBLE_SHA_NI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

typedef struct { uint32_t h[8]; } sha256_t;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256_t *s, const uint8_t *p) {
    uint32_t w[64], a, b, c, d, e, f, g, h;
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = s->h[0]; b = s->h[1]; c = s->h[2]; d = s->h[3];
    e = s->h[4]; f = s->h[5]; g = s->h[6]; h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) +
                      K256[i] + w[i];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    s->h[0] += a; s->h[1] += b; s->h[2] += c; s->h[3] += d;
    s->h[4] += e; s->h[5] += f; s->h[6] += g; s->h[7] += h;
}

/* The x86 SHA extensions: four rounds per pair of sha256rnds2, the message schedule by
 * sha256msg1/msg2.  The state is held as (a, b, e, f) and (c, d, g, h), the instructions'
 * order. */
#ifdef NIMBLE_SHA_NI
__attribute__((target("sha,ssse3,sse4.1")))
static void sha256_blocks_ni(sha256_t *s, const uint8_t *p, size_t blocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&s->h[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&s->h[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (size_t b = 0; b < blocks; b++, p += 64) {
        __m128i w[16], saved_abef = abef, saved_cdgh = cdgh;
        for (int k = 0; k < 4; k++)
            w[k] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * k)), bswap);
        for (int k = 4; k < 16; k++)
            w[k] = _mm_sha256msg2_epu32(
                _mm_add_epi32(_mm_sha256msg1_epu32(w[k - 4], w[k - 3]),
                              _mm_alignr_epi8(w[k - 1], w[k - 2], 4)),
                w[k - 1]);
        for (int k = 0; k < 16; k++) {
            __m128i msg = _mm_add_epi32(w[k], _mm_loadu_si128((const __m128i *)&K256[4 * k]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, msg);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(msg, 0x0E));
        }
        abef = _mm_add_epi32(abef, saved_abef);
        cdgh = _mm_add_epi32(cdgh, saved_cdgh);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&s->h[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&s->h[4], _mm_alignr_epi8(dchg, feba, 8));
}

static int sha_ni;
static pthread_once_t sha_ni_asked = PTHREAD_ONCE_INIT;

static void ask_sha_ni(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    sha_ni = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 29 & 1u) &&
             !getenv("NIMBLE_NO_SHA_NI");
}

/* The CPU has the SHA extensions and NIMBLE_NO_SHA_NI does not turn them off, asked once: a
 * load hashes on the checksum's threads and the kernels' at once, so the first answer is
 * published through pthread_once rather than raced. */
static int use_sha_ni(void) {
    pthread_once(&sha_ni_asked, ask_sha_ni);
    return sha_ni;
}
#endif

/* `blocks` 64-byte blocks, on the SHA extensions where the CPU has them. */
static void sha256_blocks(sha256_t *s, const uint8_t *p, size_t blocks) {
#ifdef NIMBLE_SHA_NI
    if (use_sha_ni()) {
        sha256_blocks_ni(s, p, blocks);
        return;
    }
#endif
    for (size_t b = 0; b < blocks; b++) sha256_block(s, p + 64 * b);
}

void nimble_sha256(const uint8_t *data, size_t n, uint8_t out[32]) {
    static const uint32_t init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    sha256_t s;
    memcpy(s.h, init, sizeof init);
    size_t full = n / 64 * 64;
    sha256_blocks(&s, data, full / 64);
    uint8_t tail[128] = {0};
    size_t rest = n - full;
    memcpy(tail, data + full, rest);
    tail[rest] = 0x80;
    size_t len = rest + 9 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) tail[len - 1 - i] = (uint8_t)(bits >> (8 * i));
    sha256_blocks(&s, tail, len / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s.h[i] >> 24); out[4 * i + 1] = (uint8_t)(s.h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s.h[i] >> 8); out[4 * i + 3] = (uint8_t)s.h[i];
    }
}

#define CHUNK ((size_t)8 << 20)
#define MAX_THREADS 8

/* Items are claimed one at a time from a shared counter, not dealt out in turn: the loader's
 * items (one per kernel binary) differ in cost by orders of magnitude, and a thread that drew
 * small ones takes the next item rather than sitting idle beside one that drew large ones. */
typedef struct { void (*fn)(void *, size_t); void *arg; size_t count; atomic_size_t next; } share_t;

static void *run_share(void *p) {
    share_t *job = p;
    for (size_t i = atomic_fetch_add(&job->next, 1); i < job->count;
         i = atomic_fetch_add(&job->next, 1))
        job->fn(job->arg, i);
    return NULL;
}

void nimble_spread(void (*fn)(void *arg, size_t i), void *arg, size_t count) {
    size_t threads = count < MAX_THREADS ? count : MAX_THREADS;
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    share_t job = {fn, arg, count, 0};
    for (size_t t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run_share, &job) == 0;
    run_share(&job); /* returns once every item is claimed: a thread not started claims none */
    for (size_t t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
}

typedef struct { const uint8_t *const *data; const size_t *n; uint8_t (*out)[32]; } many_t;

static void hash_one(void *arg, size_t i) {
    many_t *job = arg;
    nimble_sha256(job->data[i], job->n[i], job->out[i]);
}

void nimble_sha256_many(const uint8_t *const *data, const size_t *n, uint8_t (*out)[32],
                        size_t count) {
    many_t job = {data, n, out};
    nimble_spread(hash_one, &job, count);
}

void nimble_checksum(const uint8_t *data, size_t n, uint8_t out[32]) {
    size_t count = (n + CHUNK - 1) / CHUNK;
    const uint8_t **chunks = malloc(sizeof *chunks * (count + 1));
    size_t *sizes = malloc(sizeof *sizes * (count + 1));
    uint8_t (*digests)[32] = malloc(sizeof *digests * (count + 1));
    if (!chunks || !sizes || !digests) {
        memset(out, 0, 32);
    } else {
        for (size_t i = 0; i < count; i++) {
            chunks[i] = data + i * CHUNK;
            sizes[i] = n - i * CHUNK < CHUNK ? n - i * CHUNK : CHUNK;
        }
        nimble_sha256_many(chunks, sizes, digests, count);
        nimble_sha256((const uint8_t *)digests, 32 * count, out);
    }
    free(chunks);
    free(sizes);
    free(digests);
}
