/* SHA-256 (FIPS 180-4), the saved file's checksum, and the work they and the loader spread
 * over threads, for Nimble's C runtime (internal). */
#ifndef NIMBLE_SHA256_H
#define NIMBLE_SHA256_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The SHA-256 digest of n bytes at data. */
void nimble_sha256(const uint8_t *data, size_t n, uint8_t out[32]);

/* The saved file's checksum of n bytes: SHA-256 of the SHA-256 digests of their consecutive
 * 8 MiB chunks (the last one shorter), the chunks hashed on up to 8 threads. */
void nimble_checksum(const uint8_t *data, size_t n, uint8_t out[32]);

/* The SHA-256 digest of each of `count` byte strings (data[i], n[i] bytes) into out[i], on up
 * to 8 threads. */
void nimble_sha256_many(const uint8_t *const *data, const size_t *n, uint8_t (*out)[32],
                        size_t count);

/* fn(arg, i) for every i < count, on up to 8 threads, this one among them, each item taken by
 * the next thread free (where no thread can be started, this one runs them all). */
void nimble_spread(void (*fn)(void *arg, size_t i), void *arg, size_t count);

#ifdef __cplusplus
}
#endif

#endif /* NIMBLE_SHA256_H */
