"""The lock that runs the collectives of a context and its sub-groups one at a time
(``CallLock``), also the guard of a context's runner (pycollect/_ext/_work.pyx)."""

cdef extern from "<semaphore.h>" nogil:
    int sem_init(sem_t* s, int pshared, unsigned int value)
    int sem_destroy(sem_t* s)
    int sem_wait(sem_t* s)
    int sem_post(sem_t* s)

cdef extern from *:
    """
    /* CallLock's word: takers and givers hold the GIL, which orders them, so a plain
       load and store do; where there is no GIL (a free-threaded build) they are atomic. */
    #ifdef Py_GIL_DISABLED
    static inline int pc_lock_try(int* held) { return __atomic_exchange_n(held, 1, __ATOMIC_ACQUIRE) == 0; }
    static inline void pc_lock_clear(int* held) { __atomic_store_n(held, 0, __ATOMIC_RELEASE); }
    static inline int pc_lock_add(int* n, int d) { return __atomic_add_fetch(n, d, __ATOMIC_SEQ_CST); }
    #else
    static inline int pc_lock_try(int* held) { if (*held) return 0; *held = 1; return 1; }
    static inline void pc_lock_clear(int* held) { *held = 0; }
    static inline int pc_lock_add(int* n, int d) { return *n += d; }
    #endif
    """
    bint pc_lock_try(int* held) noexcept
    void pc_lock_clear(int* held) noexcept
    int pc_lock_add(int* n, int d) noexcept

__all__ = ["CallLock"]


cdef class CallLock:
    """The lock that runs the collectives of a context and its sub-groups one at a time.

    Every taker holds the GIL, so the lock is a word the GIL guards: taking a free lock
    is a load and a store, with no atomic instruction and no clock read (a Python lock's
    acquire makes both); ``with lock:`` from Python.  A thread that finds it held counts
    itself a waiter and sleeps on a semaphore with the GIL released; the giver posts the
    semaphore when a waiter is counted, and a woken waiter takes the lock only if it is
    free by then (else it waits again).  The thread that takes it gives it back."""

    def __cinit__(self):
        if sem_init(&self.wake, 0, 0) != 0:
            raise MemoryError()

    def __dealloc__(self):
        sem_destroy(&self.wake)

    cdef bint take(self) noexcept:
        """Take the lock; whether this had to wait for it."""
        if pc_lock_try(&self.held):
            return False
        self.wait()
        return True

    cdef bint try_take(self) noexcept:
        """Take the lock if it is free; whether this did (it never waits)."""
        return pc_lock_try(&self.held)

    cdef void wait(self) noexcept:
        while True:
            pc_lock_add(&self.waiters, 1)
            if pc_lock_try(&self.held):       # given back in between (free-threaded builds)
                pc_lock_add(&self.waiters, -1)
                return
            with nogil:
                while sem_wait(&self.wake) != 0:    # EINTR: a signal came; wait on
                    pass
            pc_lock_add(&self.waiters, -1)
            if pc_lock_try(&self.held):
                return

    cdef void give(self) noexcept:
        pc_lock_clear(&self.held)
        if pc_lock_add(&self.waiters, 0) > 0:
            sem_post(&self.wake)

    cdef bint is_wanted(self) noexcept:
        """Whether a thread waits to take the lock."""
        return pc_lock_add(&self.waiters, 0) > 0

    @property
    def wanted(self):
        """Whether a thread waits to take the lock (the runner's drive of a batch, which
        holds it, then hands the batch back between its slices: ``Runner``)."""
        return self.is_wanted()

    def __enter__(self):
        self.take()
        return self

    def __exit__(self, *exc_info):
        self.give()
        return False
