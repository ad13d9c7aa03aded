/*
 * cdmlfs._fuseloop: libfuse3's fuse_main with a single-threaded loop that busy-polls briefly.
 *
 * Why: a FUSE request is a round trip between two threads, usually on two CPUs. When the
 * daemon's CPU has gone idle, waking it costs an inter-processor interrupt, and inside a
 * virtual machine whose idle vCPUs halt at once (cpuidle haltpoll with guest_halt_poll_ns=0)
 * that wake-up is tens of microseconds: more than serving the request. A reader that opens and
 * reads small files one after another sends its next request within microseconds of our reply.
 * So after each request the loop keeps asking /dev/fuse (non-blocking) for the next one for a
 * short time before it sleeps in poll(). Measured on the CI machine kind, see the README.
 *
 * Everything else is what libfuse's fuse_main_real does (helper.c): parse the command line,
 * fuse_new, mount, signal handlers, loop, unmount. The Python side (cdmlfs.fastpath) swaps
 * this in for fuse_main_real when the daemon runs single-threaded.
 */
#define PY_SSIZE_T_CLEAN
#define FUSE_USE_VERSION 31
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <fuse_lowlevel.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static atomic_long spin_ns = 50000;         /* how long to poll for the next request */
static atomic_ullong requests, woke_spinning, woke_sleeping;

static inline int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* fuse_session_loop, with a busy-poll window after each request. */
static int
spin_loop(struct fuse_session *se)
{
    struct fuse_buf fbuf = {.mem = NULL};
    int fd = fuse_session_fd(se);
    int flags = fcntl(fd, F_GETFL);
    int nonblocking = flags != -1 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) != -1;
    int res = 0;
    int64_t last = now_ns();
    int slept = 0;
    while (!fuse_session_exited(se)) {
        res = fuse_session_receive_buf(se, &fbuf);
        if (res == -EAGAIN) {
            if (now_ns() - last < atomic_load_explicit(&spin_ns, memory_order_relaxed))
                continue;
            struct pollfd p = {.fd = fd, .events = POLLIN};
            /* A finite wait: a signal taken by another thread sets the exit flag without waking us. */
            if (poll(&p, 1, 1000) < 0 && errno != EINTR) {
                res = -errno;
                break;
            }
            slept = 1;
            continue; /* a signal sets the exit flag; otherwise a request is waiting */
        }
        if (res == -EINTR)
            continue;
        if (res <= 0)
            break; /* 0: unmounted (ENODEV) */
        atomic_fetch_add_explicit(slept ? &woke_sleeping : &woke_spinning, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&requests, 1, memory_order_relaxed);
        fuse_session_process_buf(se, &fbuf);
        last = now_ns();
        slept = !nonblocking;
    }
    free(fbuf.mem);
    fuse_session_reset(se);
    return res < 0 ? -1 : 0;
}

/* Same contract and exit codes as libfuse 3's fuse_main_real. */
static int
cdmlfs_fuse_main(int argc, char *argv[], const struct fuse_operations *op, size_t op_size, void *user_data)
{
    struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
    struct fuse_cmdline_opts opts;
    struct fuse *fuse = NULL;
    struct fuse_session *se;
    int res;

    if (fuse_parse_cmdline(&args, &opts) != 0)
        return 1;
    if (!opts.mountpoint) {
        fuse_log(FUSE_LOG_ERR, "error: no mountpoint specified\n");
        res = 2;
        goto out1;
    }
    fuse = fuse_new(&args, op, op_size, user_data);
    if (!fuse) {
        res = 3;
        goto out1;
    }
    if (fuse_mount(fuse, opts.mountpoint) != 0) {
        res = 4;
        goto out2;
    }
    if (fuse_daemonize(opts.foreground) != 0) {
        res = 5;
        goto out3;
    }
    se = fuse_get_session(fuse);
    if (fuse_set_signal_handlers(se) != 0) {
        res = 6;
        goto out3;
    }
    res = spin_loop(se) ? 7 : 0;
    fuse_remove_signal_handlers(se);
out3:
    fuse_unmount(fuse);
out2:
    fuse_destroy(fuse);
out1:
    free(opts.mountpoint);
    fuse_opt_free_args(&args);
    return res;
}

/* ------------------------------------------------------------ Python module */

static PyObject *
fl_address(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)cdmlfs_fuse_main);
}

static PyObject *
fl_set_spin_us(PyObject *Py_UNUSED(self), PyObject *arg)
{
    long us = PyLong_AsLong(arg);
    if (us == -1 && PyErr_Occurred())
        return NULL;
    if (us < 0 || us > 1000000) {
        PyErr_SetString(PyExc_ValueError, "spin time must be between 0 and 1000000 microseconds");
        return NULL;
    }
    atomic_store(&spin_ns, us * 1000);
    Py_RETURN_NONE;
}

static PyObject *
fl_stats(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("{sKsKsKsl}", "requests", (unsigned long long)atomic_load(&requests), "woke_spinning",
                         (unsigned long long)atomic_load(&woke_spinning), "woke_sleeping",
                         (unsigned long long)atomic_load(&woke_sleeping), "spin_us", atomic_load(&spin_ns) / 1000);
}

static PyMethodDef fl_methods[] = {
    {"fuse_main_address", fl_address, METH_NOARGS,
     "Address of a drop-in fuse_main_real(argc, argv, ops, ops_size, user_data) with the polling loop."},
    {"set_spin_us", fl_set_spin_us, METH_O, "set_spin_us(n): poll for the next request for n microseconds (0: never)."},
    {"stats", fl_stats, METH_NOARGS, "Requests served, and how many found the loop polling or asleep."},
    {NULL},
};

static struct PyModuleDef fl_module = {
    PyModuleDef_HEAD_INIT, "cdmlfs._fuseloop", "libfuse3 main loop that busy-polls briefly between requests.", -1,
    fl_methods,
};

PyMODINIT_FUNC
PyInit__fuseloop(void)
{
    return PyModule_Create(&fl_module);
}
