/* An LD_PRELOAD shim for tests/gpu/thread_failure_scenario.py: fails one chosen
 * cudaEventRecord made by a thread other than the one that armed it (kvio_cuda's library
 * thread), so a write-back handed to that thread fails part way through its pipeline.
 *
 *   kvio_fault_arm(-1)  count the other threads' calls from now on, fail none
 *   kvio_fault_arm(n)   count them from now on and fail the n-th (cudaErrorInvalidValue)
 *   kvio_fault_arm(0)   off
 *
 * It needs no CUDA header: the runtime's handles are pointers and its status an int. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

typedef int (*record_fn)(void *, void *);

static atomic_int armed = 0;
static atomic_int seen = 0;
static atomic_int fired = 0;
static pthread_t armer;

int kvio_fault_arm(int nth) {
    armer = pthread_self();
    atomic_store(&armed, 0);
    atomic_store(&seen, 0);
    atomic_store(&fired, 0);
    atomic_store(&armed, nth);
    return 0;
}

int kvio_fault_seen(void) { return atomic_load(&seen); }

int kvio_fault_fired(void) { return atomic_load(&fired); }

static record_fn real_record(void) {
    static record_fn real = NULL;
    if (real == NULL) {
        real = (record_fn)dlsym(RTLD_NEXT, "cudaEventRecord");
    }
    if (real == NULL) {
        void *handle = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
        if (handle == NULL) handle = dlopen("libcudart.so.12", RTLD_NOW | RTLD_NOLOAD);
        if (handle != NULL) real = (record_fn)dlsym(handle, "cudaEventRecord");
    }
    return real;
}

int cudaEventRecord(void *event, void *stream) {
    const int nth = atomic_load(&armed);
    if (nth != 0 && !pthread_equal(pthread_self(), armer)) {
        const int k = atomic_fetch_add(&seen, 1) + 1;
        if (nth > 0 && k == nth) {
            atomic_store(&fired, 1);
            return 1; /* cudaErrorInvalidValue: not sticky */
        }
    }
    record_fn real = real_record();
    return real != NULL ? real(event, stream) : 999; /* cudaErrorUnknown */
}
