"""The runner thread's doorbell: it sleeps, without the GIL, until an operation needs it.

A context's ``Runner`` (pycollect/work.py) has a thread that runs queued operations, and a
thread that waits for a queued operation runs it itself (``Work.wait``).  Waking the runner
for every operation costs more than the operation: on a virtual machine a thread's wake-up
and sleep take several microseconds of a core that the ranks spin on, and a runner that wakes
into Python takes the GIL from the waiter inside its collective.  So the runner wakes for an
operation only when nobody has taken it for a while.

The doorbell counts the operations queued and those taken (by the runner or by a waiter);
the runner's ``sleep`` reads the counts without the GIL and returns when one has stayed
untaken from one look to the next (none was taken in between, and they are taken in
order), a waiter left operations queued behind the one it ran or sends and receives in
flight (``hurry``: a thread that found that one running waits for the runner to run its
own), or ``stop`` was called.  It looks every ``TICK_US`` microseconds while operations keep coming; after ``IDLE_MS``
milliseconds with nothing queued it sleeps until ``queue`` posts its semaphore.  An
operation that nobody waits for thus starts within about two looks (the first after a quiet
spell: at once, plus one look).  The counts are changed by threads that hold the GIL and read
by the sleeper without it, so they are atomic; ``queue`` adds before it looks whether the
runner sleeps for good, and ``sleep`` says so before it looks at the counts, so one of the
two sees the other.
"""

cdef extern from "<semaphore.h>" nogil:
    int sem_init(sem_t* s, int pshared, unsigned int value)
    int sem_destroy(sem_t* s)
    int sem_wait(sem_t* s)
    int sem_post(sem_t* s)
    int sem_trywait(sem_t* s)

cdef extern from *:
    """
    #include <semaphore.h>
    #include <time.h>
    static inline long long pc_bell_load(long long* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    static inline void pc_bell_add(long long* p, long long d) { __atomic_add_fetch(p, d, __ATOMIC_SEQ_CST); }
    static inline int pc_bell_get(int* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    static inline void pc_bell_set(int* p, int v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
    static inline int pc_bell_xchg(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
    static inline long long pc_bell_now(void) {
        struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
        return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
    }
    /* Sleep on the semaphore for at most ns (a post or a signal ends it sooner). */
    static inline void pc_bell_nap(sem_t* s, long long ns) {
        struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
        long long end = (long long)t.tv_sec * 1000000000LL + t.tv_nsec + ns;
        t.tv_sec = end / 1000000000LL; t.tv_nsec = end % 1000000000LL;
        sem_clockwait(s, CLOCK_MONOTONIC, &t);
    }
    """
    long long pc_bell_load(long long* p) noexcept nogil
    void pc_bell_add(long long* p, long long d) noexcept nogil
    int pc_bell_get(int* p) noexcept nogil
    void pc_bell_set(int* p, int v) noexcept nogil
    int pc_bell_xchg(int* p, int v) noexcept nogil
    long long pc_bell_now() noexcept nogil
    void pc_bell_nap(sem_t* s, long long ns) noexcept nogil

__all__ = ["Doorbell", "IDLE_MS", "TICK_US"]

TICK_US = 500       # how often a watching runner looks for untaken operations
IDLE_MS = 5         # after this long with nothing queued, it sleeps until woken
cdef long long _TICK_NS = TICK_US * 1000
cdef long long _IDLE_NS = IDLE_MS * 1000000


cdef class Doorbell:
    """Counts of queued and taken operations, and the runner's sleep (see the module).
    Its fields: _doorbell.pxd."""

    def __cinit__(self):
        if sem_init(&self.wake, 0, 0) != 0:
            raise MemoryError()

    def __dealloc__(self):
        sem_destroy(&self.wake)

    cpdef void queue(self) noexcept:
        """One operation was queued: wakes the runner where it sleeps until woken."""
        pc_bell_add(&self.queued, 1)
        if pc_bell_get(&self.asleep):
            sem_post(&self.wake)

    cpdef void hurry(self) noexcept:
        """The runner must look at the queue now (what a waiter left queued behind the
        operation it ran, or in flight), whatever the counts say."""
        pc_bell_set(&self.urgent, 1)
        sem_post(&self.wake)

    cpdef void take(self) noexcept:
        """One queued operation was taken, by the runner or a waiter."""
        pc_bell_add(&self.taken, 1)

    cpdef void stop(self) noexcept:
        """End every sleep from now on at once."""
        pc_bell_set(&self.stopped, 1)
        sem_post(&self.wake)

    @property
    def untaken(self):
        """How many queued operations nobody has taken."""
        return pc_bell_load(&self.queued) - pc_bell_load(&self.taken)

    def sleep(self):
        """Sleep, with the GIL released, until the runner has something to run (an
        operation untaken from one look to the next, or ``hurry``) or ``stop`` was called;
        return whether ``stop`` was."""
        cdef int stopped = 0
        cdef long long seen = -1, taken_before = -1, q, t, now, quiet_since
        with nogil:
            quiet_since = pc_bell_now()
            while True:
                stopped = pc_bell_get(&self.stopped)
                if stopped or pc_bell_xchg(&self.urgent, 0):
                    break
                q = pc_bell_load(&self.queued)
                t = pc_bell_load(&self.taken)
                now = pc_bell_now()
                if q != seen:
                    seen = q
                    quiet_since = now
                if q > t:
                    # Taken in order: if none was taken since the last look, the oldest
                    # untaken one was there then too, a whole look ago.  Nobody waits for it.
                    if t == taken_before:
                        break
                    taken_before = t
                else:
                    taken_before = -1
                    if now - quiet_since >= _IDLE_NS:
                        # Quiet: sleep until queue() posts (it sees asleep, or this sees q).
                        pc_bell_set(&self.asleep, 1)
                        if pc_bell_load(&self.queued) == q and not pc_bell_get(&self.stopped) \
                                and not pc_bell_get(&self.urgent):
                            while sem_wait(&self.wake) != 0:    # EINTR: wait on
                                pass
                        pc_bell_set(&self.asleep, 0)
                        while sem_trywait(&self.wake) == 0:     # posts made meanwhile
                            pass
                        quiet_since = pc_bell_now()
                        continue
                pc_bell_nap(&self.wake, _TICK_NS)
        return stopped != 0
