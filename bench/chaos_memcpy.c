/* Widen thread races at small copies: an LD_PRELOAD library for bench/gloo_worker_race.py and
 * bench/sp_stress.py --chaos (issue 46).
 *
 * Every memcpy/memmove of at most 24 bytes made by a thread other than the process's main thread
 * sleeps CHAOS_DELAY_NS nanoseconds first, one call in CHAOS_EVERY (a per-thread pseudo-random
 * draw). Values are unchanged; only when the copy happens moves. A race whose window holds such a
 * copy (the one it was built for: torch's ProcessGroupGloo::runLoop copying an operation's name into
 * a std::string another worker thread has just freed) then loses it far more often than by chance.
 *
 *     gcc -O2 -shared -fPIC -o libchaos.so bench/chaos_memcpy.c -ldl
 *     LD_PRELOAD=./libchaos.so CHAOS_EVERY=4 CHAOS_DELAY_NS=100000 python ...
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef void *(*copy_fn)(void *, const void *, size_t);
static copy_fn real_memmove, real_memcpy;
static unsigned every = 64;
static long delay_ns = 20000;
static __thread unsigned long long state;

__attribute__((constructor)) static void chaos_init(void) {
  real_memmove = (copy_fn)dlsym(RTLD_NEXT, "memmove");
  real_memcpy = (copy_fn)dlsym(RTLD_NEXT, "memcpy");
  const char *e = getenv("CHAOS_EVERY"), *d = getenv("CHAOS_DELAY_NS");
  if (e) every = (unsigned)atoi(e);
  if (d) delay_ns = atol(d);
}

static void maybe_delay(size_t n) {
  if (n > 24 || every == 0 || delay_ns <= 0) return;
  long tid = syscall(SYS_gettid);
  if (tid == getpid()) return; /* the main thread runs as it would */
  if (!state) state = (unsigned long long)tid * 2654435761ULL + 1;
  state = state * 6364136223846793005ULL + 1442695040888963407ULL;
  if ((state >> 33) % every) return;
  struct timespec ts = {delay_ns / 1000000000L, delay_ns % 1000000000L};
  nanosleep(&ts, NULL);
}

/* Before the constructor has run (a copy made while libraries load): byte by byte. */
static void *copy_bytes(void *d, const void *s, size_t n) {
  unsigned char *dp = d;
  const unsigned char *sp = s;
  if (dp < sp)
    for (size_t i = 0; i < n; i++) dp[i] = sp[i];
  else
    for (size_t i = n; i > 0; i--) dp[i - 1] = sp[i - 1];
  return d;
}

void *memmove(void *d, const void *s, size_t n) {
  maybe_delay(n);
  return real_memmove ? real_memmove(d, s, n) : copy_bytes(d, s, n);
}

void *memcpy(void *d, const void *s, size_t n) {
  maybe_delay(n);
  return real_memcpy ? real_memcpy(d, s, n) : copy_bytes(d, s, n);
}
