/* A small pool of worker threads for the native kernels: fn(args, lo, hi) over [0, n)
 * cut into `parts` ranges, part 0 on the calling thread, part i offered to worker i.
 *
 * Why: a decode step calls ~40 kernels of 20-500 us each. Handing parts to Python
 * helper threads (a ThreadPoolExecutor: a futex wake, the GIL, a ctypes call) cost
 * ~100 us a call, more than a small projection's whole work on one core. Here a worker
 * spins (pause) for SPIN_NS after each part, so the next call of the same step finds it
 * awake (~1 us a hand-off); past that it sleeps on its condition variable, so an idle
 * engine burns nothing. A caller whose calls come alone (the KV receiver: one chunk, then
 * socket I/O for a millisecond) asks for no spin (pd_par_run_chunks_spin with 0): there
 * a spinning worker would take a core from the threads moving the bytes.
 *
 * Protocol, per worker w: one ticket, odd = a part offered, even = taken.
 *     caller: mailbox[w] = (fn, args, lo, hi); ticket = 2j+1 (release); wake w if asleep
 *     taking: CAS ticket 2j+1 -> 2j+2; only the winner reads the mailbox and runs it
 *     worker: takes it -> runs it -> done = j (release)
 *     caller: after its own part takes back every part no worker took (a worker asleep,
 *             or descheduled by a busy machine, is never waited for), runs those, then
 *             waits for done == j of the parts workers took (they are running)
 * The caller writes a mailbox only when its last part was taken back or done, so no
 * worker reads it meanwhile. Sleeping (Dekker, seq_cst): the worker stores asleep = 1,
 * then re-reads the ticket under its mutex before waiting; the caller stores the ticket,
 * then reads asleep and, if set, signals under the same mutex: no lost wake-up.
 *
 * One caller at a time owns the workers (a try-lock); a second concurrent caller (the
 * offline LLM runs prefill and decode forwards on two threads) runs all its parts on
 * its own thread: same results, no waiting. After fork() the child has no workers; the
 * atfork handler forgets them, and the child starts its own on first use. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define MAX_WORKERS 63
#define SPIN_NS 200000 /* 0.2 ms: longer than the host work between two kernels of a step */

typedef void (*range_fn)(const void *args, int64_t lo, int64_t hi);

typedef struct {
    _Atomic uint64_t ticket, done;
    _Atomic int asleep;
    _Atomic int64_t spin_ns; /* how long to spin after the part being run (offer's caller) */
    range_fn fn;
    const void *args;
    int64_t lo, hi;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char pad[64];
} Worker;

static Worker workers[MAX_WORKERS];
static uint64_t jobs; /* parts offered so far (guarded by owner) */
static int started;   /* workers running (guarded by owner) */
static pthread_mutex_t owner = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Take worker w's offered part (ticket odd); true if this thread won it. */
static int take(Worker *w, uint64_t *t) {
    uint64_t odd = atomic_load(&w->ticket);
    if (!(odd & 1)) return 0;
    *t = odd;
    return atomic_compare_exchange_strong(&w->ticket, &odd, odd + 1);
}

static void wait_for_offer(Worker *w) {
    int64_t until = now_ns() + atomic_load_explicit(&w->spin_ns, memory_order_relaxed);
    for (int i = 0; !(atomic_load(&w->ticket) & 1); i++) {
        PAUSE();
        if ((i & 63) == 63 && now_ns() > until) {
            pthread_mutex_lock(&w->mu);
            atomic_store(&w->asleep, 1);
            while (!(atomic_load(&w->ticket) & 1)) pthread_cond_wait(&w->cv, &w->mu);
            atomic_store(&w->asleep, 0);
            pthread_mutex_unlock(&w->mu);
            return;
        }
    }
}

static void *worker_main(void *arg) {
    Worker *w = arg;
    for (;;) {
        wait_for_offer(w);
        uint64_t t;
        if (take(w, &t)) { /* else the caller took it back: wait for the next */
            w->fn(w->args, w->lo, w->hi);
            atomic_store_explicit(&w->done, t, memory_order_release);
        }
    }
    return 0;
}

static void forget_workers(void) { /* in the child after fork: the threads are gone */
    started = 0;
    pthread_mutex_init(&owner, 0);
}

static void register_atfork(void) { pthread_atfork(0, 0, forget_workers); }

static int start_workers(int want) { /* caller holds owner; returns min(want, running) */
    pthread_once(&atfork_once, register_atfork);
    while (started < want) {
        Worker *w = &workers[started];
        atomic_store(&w->ticket, 0);
        atomic_store(&w->done, 0);
        atomic_store(&w->asleep, 0);
        atomic_store(&w->spin_ns, SPIN_NS);
        pthread_mutex_init(&w->mu, 0);
        pthread_cond_init(&w->cv, 0);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker_main, w);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        started++;
    }
    return started < want ? started : want;
}

static void offer(Worker *w, range_fn fn, const void *args, int64_t lo, int64_t hi,
                  int64_t spin_ns) {
    atomic_store_explicit(&w->spin_ns, spin_ns, memory_order_relaxed);
    w->fn = fn;
    w->args = args;
    w->lo = lo;
    w->hi = hi;
    jobs++;
    atomic_store(&w->ticket, 2 * jobs + 1);
    if (atomic_load(&w->asleep)) {
        pthread_mutex_lock(&w->mu);
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
}

/* After the caller's own part: takes back every offer to workers 0..helpers-1 that no
 * worker took (running it here when `run_taken_back`), and waits for the parts that
 * workers took. Returns how many workers took theirs. */
static int join(int helpers, int run_taken_back) {
    int on_workers = 0;
    for (int i = 0; i < helpers; i++) {
        Worker *w = &workers[i];
        uint64_t t;
        if (take(w, &t)) { /* not started: run it here rather than wait for a wake-up */
            if (run_taken_back) w->fn(w->args, w->lo, w->hi);
            continue;
        }
        uint64_t mine = atomic_load(&w->ticket) - 1; /* the odd ticket the worker took */
        for (int k = 0; atomic_load_explicit(&w->done, memory_order_acquire) != mine; k++) {
            PAUSE();
            if (k > 4096) sched_yield(); /* a worker descheduled mid-part: let it run */
        }
        on_workers++;
    }
    return on_workers;
}

/* fn(args, lo, hi) for the `parts` near-equal ranges of [0, n); returns when all ran.
 * Returns the number of parts that ran on workers (0: all on this thread). */
int pd_par_run(range_fn fn, const void *args, int64_t n, int parts) {
    if (parts > n) parts = (int)n;
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1 || pthread_mutex_trylock(&owner) != 0) {
        if (n > 0) fn(args, 0, n);
        return 0;
    }
    int helpers = start_workers(parts - 1);
    parts = helpers + 1;
    for (int i = 0; i < helpers; i++)
        offer(&workers[i], fn, args, n * (i + 1) / parts, n * (i + 2) / parts, SPIN_NS);
    fn(args, 0, n / parts);
    int on_workers = join(helpers, 1);
    pthread_mutex_unlock(&owner);
    return on_workers;
}

/* Chunks: [0, n) in chunks of `grain`, every thread of a call taking the next untaken
 * chunk until none is left (an atomic counter), instead of one fixed range each.
 *
 * Why: a fixed split waits for its slowest part. On a host whose cores other processes
 * also use (the router, the HTTP servers, a client), a part's thread is preempted for
 * milliseconds now and then, and its partner, done with its own range, waits that long
 * at the join: a prefill forward on 2 threads beside a process using 30% of a core ran
 * 1.24x its one-thread speed instead of 1.8x. With chunks the thread that runs takes the
 * preempted one's share of the rest; the join waits at most for a chunk in progress.
 *
 * The counter lives in `drain`, which a call owns (under `owner`) until every worker
 * that took its offer is done: a worker that wakes late finds the counter past the end
 * and does nothing. Each chunk is one fn(args, lo, hi) call, as a fixed part is, so a
 * kernel whose ranges write disjoint outputs gives the same bits either way. */
typedef struct {
    range_fn fn;
    const void *args;
    int64_t n, grain;
    _Atomic int64_t next;
} Drain;

static Drain drain; /* guarded by owner */

static void drain_chunks(const void *arg, int64_t lo, int64_t hi) {
    (void)lo, (void)hi;
    Drain *d = (Drain *)arg;
    for (;;) {
        int64_t at = atomic_fetch_add(&d->next, d->grain);
        if (at >= d->n) return;
        d->fn(d->args, at, at + d->grain < d->n ? at + d->grain : d->n);
    }
}

/* fn(args, lo, hi) over [0, n) in chunks of `grain`, on up to `parts` threads; returns
 * when all ran. Returns the number of workers that took part (0: all on this thread).
 * A worker that took part spins `spin_ns` afterwards (pd_par_run_chunks: SPIN_NS, for
 * the next kernel of a step), then sleeps: 0 for a call that comes alone (the KV
 * receiver's, between which a spinning worker would take a core from the socket I/O). */
int pd_par_run_chunks_spin(range_fn fn, const void *args, int64_t n, int parts, int64_t grain,
                           int64_t spin_ns) {
    if (grain < 1) grain = 1;
    int64_t chunks = (n + grain - 1) / grain;
    if (parts > chunks) parts = (int)chunks;
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1 || pthread_mutex_trylock(&owner) != 0) {
        if (n > 0) fn(args, 0, n);
        return 0;
    }
    int helpers = start_workers(parts - 1);
    drain.fn = fn;
    drain.args = args;
    drain.n = n;
    drain.grain = grain;
    atomic_store(&drain.next, 0);
    for (int i = 0; i < helpers; i++) offer(&workers[i], drain_chunks, &drain, 0, 0, spin_ns);
    drain_chunks(&drain, 0, 0);
    int on_workers = join(helpers, 0); /* a part not started has nothing left to take */
    pthread_mutex_unlock(&owner);
    return on_workers;
}

int pd_par_run_chunks(range_fn fn, const void *args, int64_t n, int parts, int64_t grain) {
    return pd_par_run_chunks_spin(fn, args, n, parts, grain, SPIN_NS);
}

/* Tests: out[i] += 1 for i in [lo, hi) (each index must be visited exactly once). */
void pd_par_selftest(const void *args, int64_t lo, int64_t hi) {
    int64_t *out = *(int64_t *const *)args;
    for (int64_t i = lo; i < hi; i++) out[i] += 1;
}
