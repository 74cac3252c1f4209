// How fast this CPU reads a decode's KV cache in hal's layout, with no attention arithmetic: the ceiling a decode
// kernel over SGLang's pool ([slot][kv head][dim], K and V apart) cannot pass, per page size and read pattern.
//
//   g++ -O2 -march=native -fopenmp bench/read_probe.cpp -o /tmp/read_probe
//   /tmp/read_probe PAGE PATTERN THREADS [WORK [hot]]      e.g. /tmp/read_probe 16 heads+t2 2
//
// The pools are hal bench's bf16 decode: 32 requests x 2048 slots, 8 KV heads x 128 dims (2 KB a slot), K and V
// 134 MB each, pages of PAGE slots scattered (a random permutation, as kernel_ab's slot_table), a 512 MB read
// before each pass so nothing is in cache; blocks of 16 slots handed to the threads statically. Patterns:
//   slots     each slot's K rows of all heads, then its V rows, in address order (demand loads)
//   heads     head by head through a block, K then V (hal's row kernels' order), demand loads
//   heads+t2  the same, the next block's rows of the head fetched with prefetcht2 (as the kernels' Ahead does)
//   tiles     AMX tile loads of a head's 16 rows (a slot's stride apart; pages of 16 or more only), nothing
//             consuming them (AMX CPUs; WORK 0)
//   packed    the same bytes as AMX-packed pages (hal.kv_layouts' amx_packed: each page's slots of one head one
//             dense slab, heads of a page side by side, K and V apart), read as hal's AMX decode over them reads:
//             page by page, head by head, K's slab then V's as streamed tile loads of contiguous 1 KB, the next
//             page's slab of the head fetched with prefetcht2 a tile's worth per tile (pages a multiple of 32;
//             AMX CPUs; WORK 0)
// WORK (default 0): float32 multiply-adds per 64-byte line read, on the line (8 independent chains, no memory
// traffic): arithmetic standing in for a kernel's, to see whether a pattern's reads run under it or after it.
// hot: every request's keys over the first 512 slots, or the first page where pages are larger (in cache, no
// flush): the same loop's arithmetic alone.
// Prints the best of 5 passes in ms and GB/s.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
constexpr int64_t kRequests = 32, kKeys = 2048, kHeads = 8, kRowBytes = 256, kSlotBytes = kHeads * kRowBytes;
constexpr int64_t kBlock = 16;

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kVecBytes = 64;
Vec vec_zero() { return _mm512_setzero_ps(); }
float vec_sum(Vec x) { return _mm512_reduce_add_ps(x); }
Vec vec_load(const char* p) { return _mm512_load_ps(reinterpret_cast<const float*>(p)); }
Vec vec_add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
Vec vec_fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#else  // AVX2
using Vec = __m256;
constexpr int64_t kVecBytes = 32;
Vec vec_zero() { return _mm256_setzero_ps(); }
float vec_sum(Vec x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, x);
  float s = 0.f;
  for (float y : lanes) s += y;
  return s;
}
Vec vec_load(const char* p) { return _mm256_load_ps(reinterpret_cast<const float*>(p)); }
Vec vec_add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
Vec vec_fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// A thread's sums: what it read, and the WORK chains fed by it.
struct Reader {
  int work = 0;  // multiply-adds per 64-byte line
  Vec acc = vec_zero(), chain[8] = {};
  void read_row(const char* row) {
    Vec c0 = chain[0], c1 = chain[1], c2 = chain[2], c3 = chain[3], c4 = chain[4], c5 = chain[5], c6 = chain[6],
        c7 = chain[7];  // in registers for the row: the array would be a load and a store per multiply-add
    for (int64_t o = 0; o < kRowBytes; o += kVecBytes) {
      const Vec x = vec_load(row + o);
      acc = vec_add(acc, x);
      for (int w = 0; w < work * kVecBytes / 64; w += 8) {
        c0 = vec_fma(x, x, c0), c1 = vec_fma(x, x, c1), c2 = vec_fma(x, x, c2), c3 = vec_fma(x, x, c3);
        c4 = vec_fma(x, x, c4), c5 = vec_fma(x, x, c5), c6 = vec_fma(x, x, c6), c7 = vec_fma(x, x, c7);
      }
    }
    chain[0] = c0, chain[1] = c1, chain[2] = c2, chain[3] = c3, chain[4] = c4, chain[5] = c5, chain[6] = c6;
    chain[7] = c7;
  }
  float sum() const {
    Vec s = acc;
    for (const Vec& c : chain) s = vec_add(s, c);
    return vec_sum(s);
  }
};

void fetch_row(const char* row) {
  for (int64_t o = 0; o < kRowBytes; o += 64) _mm_prefetch(row + o, _MM_HINT_T2);
}

#if defined(__AMX_TILE__)
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
void tiles_begin() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 4; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12's tells the compiler that ldtilecfg reads 8 bytes of the config, so the
  // stores to the rest may be dropped as dead, and ldtilecfg faults on what the stack held (seen in
  // bench/read_probe.cpp after an unrelated change). This operand is all 64 bytes.
  asm volatile("ldtilecfg %0" ::"m"(config));
}
void tile_rows(const char* first, int64_t stride) {
  _tile_loadd(0, first, stride);
  _tile_loadd(1, first + 64, stride);
  _tile_loadd(2, first + 128, stride);
  _tile_loadd(3, first + 192, stride);
}
// A packed page's slab of one head (bytes of it) by tiles of 1 KB, four at a time; `ahead`'s as many bytes fetched.
void tile_slab(const char* slab, const char* ahead, int64_t bytes) {
  for (int64_t t = 0; t < bytes; t += 4096) {
    for (int64_t o = t; o < t + 4096; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T2);
    _tile_stream_loadd(0, slab + t, 64);
    _tile_stream_loadd(1, slab + t + 1024, 64);
    _tile_stream_loadd(2, slab + t + 2048, 64);
    _tile_stream_loadd(3, slab + t + 3072, 64);
  }
}
#endif
}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 6) {
    std::fprintf(stderr, "usage: %s PAGE slots|heads|heads+t2|tiles|packed THREADS [WORK [hot]]\n", argv[0]);
    return 2;
  }
  const int64_t page = std::atoll(argv[1]);
  const std::string pattern = argv[2];
  enum class Mode { slots, heads, heads_t2, tiles, packed, unknown };
  const Mode mode = pattern == "slots"      ? Mode::slots
                    : pattern == "heads"    ? Mode::heads
                    : pattern == "heads+t2" ? Mode::heads_t2
                    : pattern == "tiles"    ? Mode::tiles
                    : pattern == "packed"   ? Mode::packed
                                            : Mode::unknown;  // (compared once: per row it cost 3 ms in cache)
  const bool amx = mode == Mode::tiles || mode == Mode::packed;
  const int threads = std::atoi(argv[3]);
  const int work = argc > 4 ? std::atoi(argv[4]) : 0;
  const bool hot = argc > 5 && std::string(argv[5]) == "hot";
  if (work < 0 || work % (8 * 64 / kVecBytes) || (argc > 5 && !hot)) {
    std::fprintf(stderr, "expected WORK a multiple of %lld (0 for none), then optionally hot\n",
                 static_cast<long long>(8 * 64 / kVecBytes));
    return 2;
  }
  if (page < 1 || kKeys % page || threads < 1 || mode == Mode::unknown) {
    std::fprintf(stderr, "expected PAGE dividing %lld, a pattern of slots|heads|heads+t2|tiles|packed, THREADS >= 1\n",
                 static_cast<long long>(kKeys));
    return 2;
  }
#if !defined(__AMX_TILE__)
  if (amx) {
    std::fprintf(stderr, "%s: built without AMX (-march=native on a CPU without amx_tile)\n", pattern.c_str());
    return 2;
  }
#endif
  if (amx && work) {
    std::fprintf(stderr, "%s: WORK 0 only (nothing reads the tiles back)\n", pattern.c_str());
    return 2;
  }
  if (mode == Mode::packed && page % 32) {
    std::fprintf(stderr, "packed: pages of a multiple of 32 slots (whole tiles)\n");
    return 2;
  }
  if (mode == Mode::tiles && page < kBlock) {
    std::fprintf(stderr, "tiles: pages of %lld slots or more (a tile load takes one stride)\n",
                 static_cast<long long>(kBlock));
    return 2;
  }
  const int64_t slots = kRequests * kKeys, bytes = slots * kSlotBytes;
  char* k = static_cast<char*>(std::aligned_alloc(1 << 21, bytes));
  char* v = static_cast<char*>(std::aligned_alloc(1 << 21, bytes));
  std::memset(k, 0, bytes);
  std::memset(v, 0, bytes);
  std::vector<int64_t> pages(slots / page), order(slots + kBlock);
  for (int64_t i = 0; i < int64_t(pages.size()); ++i) pages[i] = i;
  std::shuffle(pages.begin(), pages.end(), std::mt19937(1));
  for (int64_t i = 0; i < slots; ++i) order[i] = (pages[i / page] * page) % (hot ? 512 : slots) + i % page;
  for (int64_t i = 0; i < kBlock; ++i) order[slots + i] = order[i];  // the last block's "next"
  std::vector<float> flush(128 << 20, 1.f);
  double best = 1e30;
  float sink = 0.f;
  for (int pass = 0; pass < 5; ++pass) {
    float f = 0.f;
    if (!hot)
      for (size_t i = 0; i < flush.size(); i += 16) f += flush[i];
    sink += f * 1e-30f;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
#if defined(__AMX_TILE__)
      if (amx) tiles_begin();
      if (mode == Mode::packed) {  // the i-th page of the requests' pages; page pg's slab of head h at (pg H + h)
        const int64_t n = slots / page, slab = page * kRowBytes, in_cache = hot ? std::max<int64_t>(1, 512 / page) : n;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
          const int64_t pg = pages[i] % in_cache, next = pages[(i + 1) % n] % in_cache;
          for (int64_t h = 0; h < kHeads; ++h)
            for (const char* pool : {k, v})
              tile_slab(pool + (pg * kHeads + h) * slab, pool + (next * kHeads + h) * slab, slab);
        }
      }
#endif
      Reader reader{work};
#pragma omp for schedule(static)
      for (int64_t b = 0; b < (mode == Mode::packed ? 0 : slots); b += kBlock) {
        const int64_t* at = order.data() + b;
        if (mode == Mode::slots) {
          for (int64_t j = 0; j < kBlock; ++j)
            for (const char* pool : {k, v})
              for (int64_t h = 0; h < kHeads; ++h) reader.read_row(pool + at[j] * kSlotBytes + h * kRowBytes);
          continue;
        }
        for (int64_t h = 0; h < kHeads; ++h)
          for (const char* pool : {k, v}) {
#if defined(__AMX_TILE__)
            if (mode == Mode::tiles) {
              tile_rows(pool + at[0] * kSlotBytes + h * kRowBytes, kSlotBytes);
              continue;
            }
#endif
            for (int64_t j = 0; j < kBlock; ++j) {
              if (mode == Mode::heads_t2) fetch_row(pool + at[kBlock + j] * kSlotBytes + h * kRowBytes);
              reader.read_row(pool + at[j] * kSlotBytes + h * kRowBytes);
            }
          }
      }
#if defined(__AMX_TILE__)
      if (amx) _tile_release();
#endif
      sink += reader.sum();
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf("page %lld %s threads %d work %d%s: %.2f ms, %.1f GB/s\n", static_cast<long long>(page),
              pattern.c_str(), threads, work, hot ? " hot" : "", best * 1e3, 2.0 * bytes / best / 1e9);
  std::free(k);
  std::free(v);
  return sink == 12345.f;  // the sums are used: the loads stay
}
