// The standalone probes' device timing: the median milliseconds of `runs` runs of `enqueue` on
// `stream`, each between two events, after one warm-up run; `before` runs untimed ahead of
// each (a kernel to queue behind, say).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "probe_check.h"

template <class Enqueue, class Before>
double event_median_ms(cudaStream_t stream, Enqueue&& enqueue, Before&& before, int runs = 7) {
    cudaEvent_t t0, t1;
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    std::vector<float> ms;
    for (int i = 0; i <= runs; ++i) {
        before();
        CK(cudaEventRecord(t0, stream));
        enqueue();
        CK(cudaEventRecord(t1, stream));
        CK(cudaEventSynchronize(t1));
        float m = 0;
        CK(cudaEventElapsedTime(&m, t0, t1));
        if (i) ms.push_back(m);
    }
    CK(cudaEventDestroy(t0));
    CK(cudaEventDestroy(t1));
    std::sort(ms.begin(), ms.end());
    return double(ms[ms.size() / 2]);
}

template <class Enqueue>
double event_median_ms(cudaStream_t stream, Enqueue&& enqueue, int runs = 7) {
    return event_median_ms(stream, enqueue, [] {}, runs);
}
