/* Runs of a memory-mapped file copied out with plain loads, a SIGBUS caught.
 *
 * A load from a page of a file truncated since it was mapped raises SIGBUS, which
 * kills a process that does not catch it (Python cannot: its handler returns and
 * the load faults again). gather() copies each run with memcpy, the GIL released,
 * and catches that one signal: while a thread copies, this module's handler is the
 * process's SIGBUS handler; a fault inside the map this thread is copying from jumps
 * back out of the copy (siglongjmp) and gather() returns False, so the caller reads
 * the runs again another way and names where the file now ends. A SIGBUS anywhere
 * else is handed to whatever handler was installed before (the default one kills
 * the process, as it would have without this module). The handler is installed by
 * the first of the threads copying at once and the previous one restored by the
 * last, unless another was installed meanwhile (which then stays): faulthandler or
 * a handler installed later is never overridden for good. A handler installed over
 * this one while a thread copies sees that thread's fault first: faulthandler reports
 * it ("Fatal Python error: Bus error"), puts this handler back and raises the signal
 * again, which this handler takes as the copy's (a SIGBUS the copying thread sent
 * itself), so the process lives on after the report. A process that removes its
 * SIGBUS handler while threads copy (faulthandler.disable()) removes theirs too: as
 * with any handler, nothing survives that. A child forked while threads copy starts
 * with none copying: the handler before is put back there and the lock is new.
 *
 * nnx_save/io/_mapped.py uses it where it was built (an optional extension), and
 * process_vm_readv otherwise.
 *
 * read_at() is the other small read: one run read with pread into a buffer, and the
 * fstat that shows the file is the one whose header was read (its size and
 * modification time), in one call with the GIL released; an element read through
 * Python's os.preadv and os.fstat costs about twice as much (nnx_save/io/_files.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Volatile: the compiler must not move these stores past the copy (memcpy reads
 * neither, so plain stores around it could be dropped as dead). */
static __thread sigjmp_buf *volatile copying_jump; /* set while this thread copies out of a map */
static __thread volatile uintptr_t copying_lo, copying_hi; /* the map's addresses [lo, hi) */

static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
static int threads_copying;
static struct sigaction previous; /* the handler before the first of the threads copying */

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    if (copying_jump != NULL) {
        uintptr_t addr = (uintptr_t)info->si_addr;
        /* A load from the map this thread copies from; or the same fault raised again by a
         * handler installed over this one while the thread copied (faulthandler reports
         * it, puts this handler back and raise()s it): a SIGBUS this thread sent itself. */
        int fault = info->si_code > 0 && addr >= copying_lo && addr < copying_hi;
        int raised = info->si_code == SI_TKILL && info->si_pid == getpid();
        if (fault || raised)
            siglongjmp(*copying_jump, 1);
    }
    /* Not a load of ours: the previous handler's, as if this one were not there. */
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, context);
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
    } else {
        /* The default action: restore it; the faulting load runs again and kills. */
        sigaction(sig, &previous, NULL);
    }
}

static int enter(void)
{
    int failed = 0;
    pthread_mutex_lock(&install_lock);
    if (threads_copying == 0) {
        struct sigaction ours, was;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_sigbus;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        failed = sigaction(SIGBUS, &ours, &was);
        /* Ours still installed (a child forked mid-copy): the handler before stays the previous. */
        if (!failed && !((was.sa_flags & SA_SIGINFO) && was.sa_sigaction == on_sigbus))
            previous = was;
    }
    if (!failed)
        threads_copying++;
    pthread_mutex_unlock(&install_lock);
    return failed;
}

static void leave(void)
{
    pthread_mutex_lock(&install_lock);
    if (--threads_copying == 0) {
        struct sigaction current;
        sigaction(SIGBUS, &previous, &current);
        /* A handler installed while threads copied (faulthandler enabled meanwhile) stays. */
        if (!(current.sa_flags & SA_SIGINFO) || current.sa_sigaction != on_sigbus)
            sigaction(SIGBUS, &current, NULL);
    }
    pthread_mutex_unlock(&install_lock);
}

/* Drop the map's pages of map bytes [begin, end): the page cache keeps them. */
static void drop_pages(const char *map, uintptr_t map_size, uintptr_t begin, uintptr_t end)
{
#ifdef MADV_DONTNEED
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = begin - begin % page, hi = (end + page - 1) / page * page;
    if (hi > map_size)
        hi = map_size;
    if (hi > lo)
        madvise((void *)(map + lo), (size_t)(hi - lo), MADV_DONTNEED);
#else
    (void)map, (void)map_size, (void)begin, (void)end;
#endif
}

/* 0: every run copied; 1: a SIGBUS in the map (the file ends sooner now); -1: the
 * handler could not be installed (nothing copied). With release > 0, the runs are
 * taken a block at a time (those starting within release bytes of the block's first),
 * each block's pages dropped once it is copied. */
static int copy_runs(char *dest, const char *map, uintptr_t map_size, const int64_t *offsets, Py_ssize_t n,
                     Py_ssize_t length, Py_ssize_t release)
{
    sigjmp_buf jump;
    if (enter() != 0)
        return -1;
    copying_lo = (uintptr_t)map;
    copying_hi = (uintptr_t)map + map_size;
    if (sigsetjmp(jump, 1) != 0) { /* from on_sigbus: the mask is restored */
        copying_jump = NULL;
        leave();
        return 1;
    }
    copying_jump = &jump;
    Py_ssize_t first = 0; /* the first run of the block being copied */
    for (Py_ssize_t k = 0; k < n; k++) {
        memcpy(dest + k * length, map + offsets[k], (size_t)length);
        if (release > 0 && (k + 1 == n || offsets[k + 1] - offsets[first] >= release)) {
            drop_pages(map, map_size, (uintptr_t)offsets[first], (uintptr_t)offsets[k] + (uintptr_t)length);
            first = k + 1;
        }
    }
    copying_jump = NULL;
    leave();
    return 0;
}

PyDoc_STRVAR(gather_doc, "gather(dest, map, map_size, offsets, length, release=0) -> bool\n\n"
                         "Copy run k (length bytes at byte offsets[k] of the map at address map,\n"
                         "map_size bytes long) to address dest + k * length. offsets: a buffer of\n"
                         "int64, each run within the map; the caller guarantees both memories.\n"
                         "With release > 0, the map's pages are dropped a block at a time (the runs\n"
                         "starting within release bytes of the block's first), once copied.\n"
                         "False when a load from the map raised SIGBUS (the file was truncated):\n"
                         "the destination then holds some runs, to be read again another way.\n"
                         "OSError when the signal handler could not be installed.");

static PyObject *gather(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned long long dest, map, map_size;
    Py_buffer offsets;
    Py_ssize_t length, release = 0;
    if (!PyArg_ParseTuple(args, "KKKy*n|n:gather", &dest, &map, &map_size, &offsets, &length, &release))
        return NULL;
    if (offsets.len % (Py_ssize_t)sizeof(int64_t) != 0 || length < 0 || release < 0) {
        PyBuffer_Release(&offsets);
        PyErr_SetString(PyExc_ValueError, "offsets must be int64, length and release non-negative");
        return NULL;
    }
    Py_ssize_t n = offsets.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *runs = (const int64_t *)offsets.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (runs[k] < 0 || (unsigned long long)runs[k] + (unsigned long long)length > map_size) {
            PyBuffer_Release(&offsets);
            PyErr_Format(PyExc_ValueError, "run %zd (bytes %lld..%lld) is outside the map's %llu bytes", k,
                         (long long)runs[k], (long long)runs[k] + (long long)length, map_size);
            return NULL;
        }
    }
    int result;
    Py_BEGIN_ALLOW_THREADS;
    result = copy_runs((char *)(uintptr_t)dest, (const char *)(uintptr_t)map, (uintptr_t)map_size, runs, n, length,
                       release);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&offsets);
    if (result < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(result == 0);
}

PyDoc_STRVAR(read_at_doc, "read_at(fd, dest, offset, size, mtime_ns) -> int\n\n"
                          "Read len(dest) bytes at byte offset of fd into the writable buffer dest\n"
                          "(pread, again on EINTR and after a partial read), then fstat fd: the bytes\n"
                          "read when the file still has size bytes and modification time mtime_ns\n"
                          "(fewer: it ended sooner), -1 when either differs (it changed: what was\n"
                          "read may mix two versions). OSError when pread or fstat fails.");

static PyObject *read_at(PyObject *Py_UNUSED(module), PyObject *args)
{
    int fd;
    Py_buffer dest;
    long long offset, size, mtime_ns;
    if (!PyArg_ParseTuple(args, "iw*LLL:read_at", &fd, &dest, &offset, &size, &mtime_ns))
        return NULL;
    if (offset < 0) {
        PyBuffer_Release(&dest);
        PyErr_SetString(PyExc_ValueError, "offset must be non-negative");
        return NULL;
    }
    Py_ssize_t done = 0;
    int failed = 0, same = 0;
    struct stat st;
    Py_BEGIN_ALLOW_THREADS;
    while (done < dest.len) {
        ssize_t n = pread(fd, (char *)dest.buf + done, (size_t)(dest.len - done), (off_t)(offset + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            failed = n < 0;
            break;
        }
        done += n;
    }
    if (!failed && fstat(fd, &st) != 0)
        failed = 1;
    if (!failed)
        same = (long long)st.st_size == size &&
               (long long)st.st_mtim.tv_sec * 1000000000LL + (long long)st.st_mtim.tv_nsec == mtime_ns;
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&dest);
    if (failed)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromSsize_t(same ? done : -1);
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"read_at", read_at, METH_VARARGS, read_at_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "nnx_save.io._gather", "Runs copied out of a memory map, SIGBUS caught.", -1, methods,
    NULL, NULL, NULL, NULL,
};

/* A child forked while threads copied has none copying: the count starts again, the
 * handler before is put back and the lock is new (a thread may have held it). */
static void after_fork_in_child(void)
{
    pthread_mutex_init(&install_lock, NULL);
    if (threads_copying > 0) {
        threads_copying = 0;
        sigaction(SIGBUS, &previous, NULL);
    }
    copying_jump = NULL;
}

PyMODINIT_FUNC PyInit__gather(void)
{
    static int registered;
    if (!registered && pthread_atfork(NULL, NULL, after_fork_in_child) != 0)
        return PyErr_Format(PyExc_OSError, "pthread_atfork failed");
    registered = 1;
    return PyModule_Create(&module);
}
