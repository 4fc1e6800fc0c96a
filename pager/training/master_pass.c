/* A float32 master's Adam/AdamW update in one pass over host memory, for
 * tensors of one block at once ([Note: a master's update in one pass] in
 * master_pass.py). Built at first use by the C compiler of the machine and
 * called through ctypes, which gives up the GIL for the call.
 *
 * The arithmetic is torch's fused CPU Adam kernel's vectorized body
 * (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) in float: the gradient
 * read from bf16, the moments and the master updated, and the master's
 * round-to-nearest-even into the bf16 weight. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { STEP_SIZE, BC2_SQRT, DECAY_MUL, L2, C1, BETA2, C2, EPS, SIGN, N_COEF };

typedef struct {
    int64_t n_tensors;
    const int64_t *sizes;
    const uint16_t *const *grads;
    float *const *masters, *const *exp_avgs, *const *exp_avg_sqs;
    uint16_t *const *weights;
    const float *coef;  /* N_COEF per tensor */
    int64_t part, parts;
} job_t;

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded;  /* (torch's: NaN stays a quiet NaN) */
}

static void adam_range(const job_t *j, int64_t k, int64_t begin, int64_t end) {
    const float *c = j->coef + k * N_COEF;
    const uint16_t *restrict grad = j->grads[k];
    float *restrict master = j->masters[k], *restrict m = j->exp_avgs[k], *restrict v = j->exp_avg_sqs[k];
    uint16_t *restrict weight = j->weights[k];
    const float neg_step = -c[STEP_SIZE], bc2 = c[BC2_SQRT], decay = c[DECAY_MUL], l2 = c[L2];
    const float c1 = c[C1], beta2 = c[BETA2], c2 = c[C2], eps = c[EPS], sign = c[SIGN];
    const int small = fabsf(c1) < 0.5f;  /* torch's lerp: two forms by the weight */
    for (int64_t i = begin; i < end; i++) {
        float g = bf16_to_float(grad[i]) * sign;
        float p = master[i];
        g = g + p * l2;
        p = p * decay;
#ifdef __FMA__
        float mi = small ? fmaf(c1, g - m[i], m[i]) : fmaf(c1 - 1.0f, g - m[i], g);
#else
        float mi = small ? m[i] + c1 * (g - m[i]) : g + (c1 - 1.0f) * (g - m[i]);
#endif
        float vi = v[i] * beta2 + c2 * g * g;
        p = p + neg_step * mi / (sqrtf(vi) / bc2 + eps);
        m[i] = mi;
        v[i] = vi;
        master[i] = p;
        weight[i] = float_to_bf16(p);
    }
}

static void *run_part(void *arg) {
    const job_t *j = (const job_t *)arg;
    for (int64_t k = 0; k < j->n_tensors; k++) {
        int64_t size = j->sizes[k];
        int64_t share = ((size + j->parts - 1) / j->parts + 15) & ~(int64_t)15;  /* (whole cache lines) */
        int64_t begin = j->part * share, end = begin + share < size ? begin + share : size;
        if (begin < end)
            adam_range(j, k, begin, end);
    }
    return NULL;
}

/* Update `n_tensors` masters, split over `threads` threads (a part whose
 * thread cannot start runs on the calling thread). */
void pager_adam_bf16(int64_t n_tensors, const int64_t *sizes, const uint16_t *const *grads,
                     float *const *masters, float *const *exp_avgs, float *const *exp_avg_sqs,
                     uint16_t *const *weights, const float *coef, int64_t threads) {
    enum { MAX_THREADS = 256 };
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = (job_t){n_tensors, sizes, grads, masters, exp_avgs, exp_avg_sqs, weights, coef, t, threads};
        started[t] = t > 0 && pthread_create(&ids[t], NULL, run_part, &jobs[t]) == 0;
    }
    for (int64_t t = 0; t < threads; t++)
        if (!started[t])
            run_part(&jobs[t]);
    for (int64_t t = 1; t < threads; t++)
        if (started[t])
            pthread_join(ids[t], NULL);
}
