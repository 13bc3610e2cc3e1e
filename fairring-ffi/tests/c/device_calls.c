/* The device calls as C sees them with FAIRRING_CUDA defined: each is bound
 * to a pointer of the signature the C ABI promises, so a declaration that
 * drifts fails to compile (-Werror). Compiled only, never linked: the library
 * exports these calls when built with its `cuda` feature. */
#define FAIRRING_CUDA 1
#include "fairring.h"

typedef fr_status (*all_reduce_fn)(const fr_comm *, void *, uint64_t, int32_t,
                                   int32_t, void *, fr_work **);
typedef fr_status (*coalesced_fn)(const fr_comm *, void *const *,
                                  const uint64_t *, size_t, int32_t, int32_t,
                                  void *, fr_work **);
typedef fr_status (*broadcast_fn)(const fr_comm *, void *, uint64_t, int32_t,
                                  uint32_t, void *, fr_work **);
typedef fr_status (*all_gather_fn)(const fr_comm *, const void *, void *,
                                   uint64_t, int32_t, void *, fr_work **);
typedef fr_status (*reduce_scatter_fn)(const fr_comm *, void *, void *,
                                       uint64_t, int32_t, int32_t, void *,
                                       fr_work **);
typedef fr_status (*enqueue_wait_fn)(const fr_work *, void *);
typedef bool (*cuda_built_fn)(void);

all_reduce_fn all_reduce = fr_all_reduce_device;
coalesced_fn coalesced = fr_all_reduce_coalesced_device;
broadcast_fn broadcast = fr_broadcast_device;
all_gather_fn all_gather = fr_all_gather_device;
reduce_scatter_fn reduce_scatter = fr_reduce_scatter_device;
enqueue_wait_fn enqueue_wait = fr_work_enqueue_wait;
cuda_built_fn cuda_built = fr_cuda_built;
