/* Floors of the prefix index's costs on this machine, nothing of the index in them.
 *
 *   cc -O2 -o /tmp/index_floor benchmarks/index_floor.c && /tmp/index_floor
 *
 * - insert: 1.33 M random 64-bit keys (the engine hashes of index_bench's 64-worker
 *   workloads, 96-key stores, ranks interleaved) into 64 open-addressing tables of
 *   40-byte records with linear probing, as the index's per-rank tables are:
 *   (a) sized for them and their pages already faulted in, with and without a
 *   prefetch 24 keys ahead; (b) growing from empty, doubling at load 0.7, each new
 *   table's pages faulted in by first touch; (c) the same, pages populated in one
 *   call (MADV_POPULATE_WRITE) as the index does, with the time spent mapping
 *   tables and moving records apart; (d) the same with homes from the hash's low
 *   bits instead of its top bits. The index also keys a second table per block and
 *   decodes msgpack, so these bound one of its per-block costs.
 * - stream: reading 80 KiB chunks of a 160 MiB buffer one cache line at a time:
 *   the bytes of one 2,048-token Python list (16 KiB of item pointers, 2,048
 *   int objects of 32 bytes), what a match from a cold token list must read.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef uint64_t u64;
typedef struct {
    u64 h;
    uint32_t c[3];
    int32_t depth;
    u64 key, hh;
} Entry; /* the index's per-rank record: 40 bytes */

enum { RANKS = 64, PER_RANK = 20768, STORE = 96, PREFETCH = 24 };
#define POPULATE_WRITE 23 /* MADV_POPULATE_WRITE (Linux 5.14) */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static u64 rng = 88172645463325252ULL;
static u64 next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* A home from the mixed hash's top bits (as the index does): a table's records are
 * in home order, and a doubling moves slot i's to about 2i, one sequential pass.
 * With low bits (low_homes) slot i's go to i or i + cap: two sequential streams,
 * which the floor shows cost the same. */
static int low_homes;
static inline size_t home(u64 k, size_t cap) {
    k ^= k >> 31;
    k *= 0x9E3779B97F4A7C15ULL;
    if (low_homes) return (size_t)(k & (cap - 1));
    return (size_t)(k >> (64 - __builtin_ctzll(cap)));
}

static Entry *table_new(size_t cap, int populate) {
    size_t bytes = cap * sizeof(Entry);
    Entry *a = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED) abort();
    if (bytes >= ((size_t)1 << 21)) madvise(a, bytes, MADV_HUGEPAGE);
    if (populate) madvise(a, bytes, POPULATE_WRITE);
    return a;
}

static inline void insert(Entry *a, size_t cap, u64 k) {
    size_t m = cap - 1, s = home(k, cap);
    while (a[s].h && a[s].h != k) s = (s + 1) & m;
    a[s].h = k;
    a[s].key = k * 3;
    a[s].c[0]++;
}

static void presized(const u64 *keys, const int *rank, size_t n, int pf) {
    const size_t cap = 32768; /* PER_RANK at load 0.63 */
    Entry *t[RANKS];
    for (int r = 0; r < RANKS; r++) {
        t[r] = table_new(cap, 0);
        memset(t[r], 0, cap * sizeof(Entry)); /* faulted in, outside the timing */
    }
    double t0 = now();
    for (size_t i = 0; i < n; i++) {
        if (pf && i + PREFETCH < n) __builtin_prefetch(&t[rank[i + PREFETCH]][home(keys[i + PREFETCH], cap)]);
        insert(t[rank[i]], cap, keys[i]);
    }
    double dt = now() - t0;
    printf("  presized, pages faulted in, %-16s %6.1f ns/insert\n", pf ? "prefetch 24:" : "no prefetch:", dt / n * 1e9);
    for (int r = 0; r < RANKS; r++) munmap(t[r], cap * sizeof(Entry));
}

static void growing(const u64 *keys, const int *rank, size_t n, int populate) {
    Entry *t[RANKS] = {0};
    size_t cap[RANKS] = {0}, count[RANKS] = {0};
    double t0 = now(), t_alloc = 0, t_move = 0;
    for (size_t i = 0; i < n; i++) {
        int r = rank[i];
        if ((count[r] + 1) * 10 > cap[r] * 7) {
            size_t nc = cap[r] ? cap[r] * 2 : 8;
            double ta = now();
            Entry *na = table_new(nc, populate);
            double tb = now();
            for (size_t j = 0; j < cap[r]; j++) {
                if (!t[r][j].h) continue;
                size_t s = home(t[r][j].h, nc);
                while (na[s].h) s = (s + 1) & (nc - 1);
                na[s] = t[r][j];
            }
            double tc = now();
            if (t[r]) munmap(t[r], cap[r] * sizeof(Entry));
            t_alloc += tb - ta + now() - tc;
            t_move += tc - tb;
            t[r] = na;
            cap[r] = nc;
        }
        int r2 = i + PREFETCH < n ? rank[i + PREFETCH] : -1;
        if (r2 >= 0 && cap[r2]) __builtin_prefetch(&t[r2][home(keys[i + PREFETCH], cap[r2])]);
        insert(t[r], cap[r], keys[i]);
        count[r]++;
    }
    double dt = now() - t0;
    printf("  growing from empty, %-26s %6.1f ns/insert (mapping %.1f, moving %.1f)%s\n",
           populate ? "pages populated per table:" : "pages faulted on touch:", dt / n * 1e9,
           t_alloc / n * 1e9, t_move / n * 1e9, low_homes ? ", homes from low bits" : "");
    for (int r = 0; r < RANKS; r++) munmap(t[r], cap[r] * sizeof(Entry));
}

static void stream(void) {
    const size_t bytes = (size_t)160 << 20, chunk = (size_t)80 << 10;
    u64 *a = malloc(bytes);
    if (!a) abort();
    memset(a, 1, bytes);
    u64 sum = 0;
    double t0 = now();
    size_t chunks = 0;
    for (size_t off = 0; off + chunk <= bytes; off += chunk, chunks++) {
        const u64 *p = (const u64 *)((const char *)a + off);
        for (size_t i = 0; i < chunk / 8; i += 8) sum += p[i];
    }
    double dt = now() - t0;
    printf("  stream: %.1f GB/s, %.2f us per 80 KiB (one cold 2,048-token list)%s\n",
           (double)chunks * chunk / dt / 1e9, dt / chunks * 1e6, sum == 42 ? " " : "");
    free(a);
}

int main(void) {
    size_t n = (size_t)RANKS * PER_RANK;
    u64 *keys = malloc(n * sizeof *keys);
    int *rank = malloc(n * sizeof *rank);
    if (!keys || !rank) abort();
    for (size_t i = 0; i < n; i++) {
        keys[i] = next() | 1;
        rank[i] = (int)((i / STORE) % RANKS);
    }
    for (int rep = 0; rep < 3; rep++) {
        printf("repeat %d: %zu inserts into %d tables\n", rep + 1, n, RANKS);
        presized(keys, rank, n, 0);
        presized(keys, rank, n, 1);
        growing(keys, rank, n, 0);
        growing(keys, rank, n, 1);
        low_homes = 1;
        growing(keys, rank, n, 1);
        low_homes = 0;
        stream();
    }
    free(keys);
    free(rank);
    return 0;
}
