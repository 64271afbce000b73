/*
 * cndrv_sim.c -- a host-memory simulator of the VMM part of libcndrv (cn_api.h).
 *
 * Exports the prototypes, struct layouts and enum values of Cambricon CNDrv
 * (cn_api.h) and enforces the rules its documentation gives:
 *
 *   - cnInit(0) before anything else (CN_ERROR_NOT_INITIALIZED otherwise);
 *   - cnMemGetInfo and the VMM calls need a context current on the calling
 *     thread (CN_CONTEXT_ERROR_INVALID otherwise): cnDeviceGet, cnCtxCreate
 *     (which binds the new context too), cnCtxGetCurrent, cnCtxSetCurrent;
 *   - CNmemAllocationProp: type DEFAULT (1), requestedHandleTypes NONE (0),
 *     location {type, id} with type DEVICE (1), allocFlags and padding zero;
 *   - cnMemMap: offset 0, flags 0, size equal to the physical size, inside a
 *     reservation, aligned, no overlap; the range stays PROT_NONE until
 *     cnMemSetAccess over mapped memory: count 1, location {DEVICE, id} with
 *     id the device the memory was created on, accessFlags READWRITE = 0 or
 *     READONLY = 1, cacheType 0-3, pinnedType 0-1;
 *   - cnMemUnmap(va, size) takes whole mappings only;
 *   - cnMemRelease of a handle still mapped succeeds: the memory goes when
 *     its last mapping does;
 *   - addresses that are not reserved or not mapped fail with
 *     CN_MEMORY_ERROR_INVALID_ADDRESS; allocations past the capacity with
 *     CN_MEMORY_ERROR_OUT_OF_MEMORY; an exhausted address space with
 *     CN_OPS_ERROR_OUT_OF_RESOURCES.
 *
 * A physical handle is a memfd; a mapping is mmap(MAP_SHARED | MAP_FIXED) of it
 * into a PROT_NONE reservation, so two mappings of one handle really alias.
 *
 * Configuration, read at first use: CNDRV_SIM_CAPACITY (bytes, default 16 GiB),
 * CNDRV_SIM_GRANULARITY (bytes, default 2 MiB), CNDRV_SIM_DEVICES (default 1);
 * or cndrv_sim_configure() before anything is allocated. cndrv_sim_count() and
 * cndrv_sim_last_error() let tests look inside.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CNresult;
typedef uint64_t CNaddr;
typedef uint64_t CNmemGenericAllocationHandle;

typedef struct { int32_t type; uint32_t id; } CNmemLocation;
typedef struct {
    int32_t type;
    int32_t requestedHandleTypes;
    CNmemLocation location;
    struct { uint8_t compressionType; uint8_t securityType; } allocFlags;
} CNmemAllocationProp;
typedef struct {
    CNmemLocation location;
    int32_t accessFlags;
    int32_t cacheType;
    int32_t pinnedType;
} CNmemAccessDesc;

_Static_assert(sizeof(CNmemAllocationProp) == 20, "CNmemAllocationProp is 20 bytes");
_Static_assert(offsetof(CNmemAllocationProp, location) == 8, "location at 8");
_Static_assert(sizeof(CNmemAccessDesc) == 20, "CNmemAccessDesc is 20 bytes");

enum {
    CN_SUCCESS = 0,
    CN_ERROR_NOT_INITIALIZED = 100002,
    CN_ERROR_INVALID_DEVICE = 100005,
    CN_ERROR_INVALID_VALUE = 100006,
    CN_OPS_ERROR_OUT_OF_RESOURCES = 100053,
    CN_MEMORY_ERROR_OUT_OF_MEMORY = 100100,
    CN_MEMORY_ERROR_INVALID_ADDRESS = 100102,
    CN_CONTEXT_ERROR_INVALID = 100201,
};
typedef uint64_t CNdev;
typedef struct CNcontext_st *CNcontext;
enum { LOC_DEVICE = 1, ALLOC_DEFAULT = 1, HANDLE_NONE = 0, PROT_READWRITE_FLAG = 0, PROT_READONLY_FLAG = 1 };

struct chunk { struct chunk *next; CNmemGenericAllocationHandle id; int fd; size_t size; int maps; int released;
               uint32_t device; };
struct context { struct context *next; uintptr_t token; CNdev dev; };
struct range { struct range *next; uintptr_t va; size_t size; };
struct mapping { struct mapping *next; uintptr_t va; size_t size; struct chunk *chunk; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int configured;
static uint64_t capacity, granularity, used, init_calls, set_access_calls, next_handle = 0x7e5700000001ULL;
static uintptr_t next_context = 0xc7c000000010ULL; /* contexts are opaque tokens */
static struct context *contexts;
static __thread uintptr_t current_context;
static uint32_t devices;
static struct chunk *chunks;
static struct range *ranges;
static struct mapping *mappings;
static __thread char last_error[256];

static uint64_t env_u64(const char *name, uint64_t fallback) {
    const char *text = getenv(name);
    return text && *text ? strtoull(text, NULL, 0) : fallback;
}

static void configure_once(void) {
    if (configured) return;
    capacity = env_u64("CNDRV_SIM_CAPACITY", 16ULL << 30);
    granularity = env_u64("CNDRV_SIM_GRANULARITY", 2ULL << 20);
    devices = (uint32_t)env_u64("CNDRV_SIM_DEVICES", 1);
    configured = 1;
}

#define ENTER() pthread_mutex_lock(&lock); configure_once()
#define LEAVE(rc) do { pthread_mutex_unlock(&lock); return (rc); } while (0)
#define REJECT(code, ...) do { snprintf(last_error, sizeof last_error, __VA_ARGS__); LEAVE(code); } while (0)
#define NEED_INIT() do { if (!init_calls) REJECT(CN_ERROR_NOT_INITIALIZED, "cnInit(0) was not called"); } while (0)
#define NEED_CONTEXT() do { NEED_INIT(); if (!current_context) \
    REJECT(CN_CONTEXT_ERROR_INVALID, "%s: no context is current on this thread", __func__); } while (0)

static struct context *find_context(uintptr_t token) {
    for (struct context *c = contexts; c; c = c->next) if (c->token == token) return c;
    return NULL;
}

static int check_location(const CNmemLocation *loc, const char *what) {
    if (loc->type != LOC_DEVICE) {
        snprintf(last_error, sizeof last_error, "%s: location.type=%d at offset +0 is not DEVICE (1); "
                 "the CNDrv location is {type, id}", what, loc->type);
        return 0;
    }
    if (loc->id >= devices) {
        snprintf(last_error, sizeof last_error, "%s: location.id=%u is not a device (have %u)", what, loc->id,
                 devices);
        return 0;
    }
    return 1;
}

static int check_prop(const CNmemAllocationProp *p) {
    const uint8_t *raw = (const uint8_t *)p;
    if (!p) { snprintf(last_error, sizeof last_error, "prop is NULL"); return 0; }
    if (p->type != ALLOC_DEFAULT) {
        snprintf(last_error, sizeof last_error, "prop.type=%d, expected DEFAULT (1)", p->type); return 0;
    }
    if (p->requestedHandleTypes != HANDLE_NONE) {
        snprintf(last_error, sizeof last_error, "prop.requestedHandleTypes=%d, expected NONE (0)",
                 p->requestedHandleTypes);
        return 0;
    }
    if (!check_location(&p->location, "prop")) return 0;
    for (size_t i = offsetof(CNmemAllocationProp, allocFlags); i < sizeof *p; i++)
        if (raw[i]) { snprintf(last_error, sizeof last_error, "prop: byte %zu (allocFlags/padding) is not zero", i);
                      return 0; }
    return 1;
}

/* A handle that was created and not yet released. */
static struct chunk *find_chunk(CNmemGenericAllocationHandle id) {
    for (struct chunk *c = chunks; c; c = c->next) if (c->id == id && !c->released) return c;
    return NULL;
}

/* Free a released chunk once nothing maps it any more. */
static void free_if_done(struct chunk *c) {
    if (!c->released || c->maps) return;
    struct chunk **link = &chunks;
    while (*link != c) link = &(*link)->next;
    *link = c->next;
    close(c->fd);
    used -= c->size;
    free(c);
}

static struct range *range_containing(uintptr_t va, size_t size) {
    for (struct range *r = ranges; r; r = r->next)
        if (va >= r->va && va + size <= r->va + r->size) return r;
    return NULL;
}

static struct mapping *mapping_overlapping(uintptr_t lo, uintptr_t hi) {
    for (struct mapping *m = mappings; m; m = m->next)
        if (m->va < hi && lo < m->va + m->size) return m;
    return NULL;
}

static struct mapping *mapping_at(uintptr_t va) {
    for (struct mapping *m = mappings; m; m = m->next) if (m->va == va) return m;
    return NULL;
}

/* [va, va + size) is exactly a run of contiguous whole mappings. */
static int covered_by_mappings(uintptr_t va, size_t size) {
    uintptr_t at = va, end = va + size;
    while (at < end) {
        struct mapping *m = mapping_at(at);
        if (!m || m->va + m->size > end) return 0;
        at += m->size;
    }
    return size > 0;
}

static void *reserve_aligned(size_t size, size_t align) {
    uint8_t *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    uintptr_t start = ((uintptr_t)raw + align - 1) / align * align;
    if (start > (uintptr_t)raw) munmap(raw, start - (uintptr_t)raw);
    uintptr_t tail = (uintptr_t)raw + size + align - (start + size);
    if (tail) munmap((void *)(start + size), tail);
    return (void *)start;
}

/* ---------------------------------------------------------------- CNDrv API */

EXPORT CNresult cnInit(unsigned int flags) {
    ENTER();
    if (flags) REJECT(CN_ERROR_INVALID_VALUE, "cnInit: flags=%u must be 0", flags);
    init_calls++;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnDeviceGetCount(int *count) {
    ENTER();
    NEED_INIT();
    if (!count) REJECT(CN_ERROR_INVALID_VALUE, "cnDeviceGetCount: count is NULL");
    *count = (int)devices;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnDeviceGet(CNdev *pdev, int ordinal) {
    ENTER();
    NEED_INIT();
    if (!pdev) REJECT(CN_ERROR_INVALID_VALUE, "cnDeviceGet: pdev is NULL");
    if (ordinal < 0 || (uint32_t)ordinal >= devices)
        REJECT(CN_ERROR_INVALID_DEVICE, "cnDeviceGet: no device %d (have %u)", ordinal, devices);
    *pdev = (CNdev)ordinal;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnCtxCreate(CNcontext *pcontext, unsigned int flags, CNdev dev) {
    (void)flags; /* the scheduling policy */
    ENTER();
    NEED_INIT();
    if (!pcontext) REJECT(CN_ERROR_INVALID_VALUE, "cnCtxCreate: pcontext is NULL");
    if (dev >= devices) REJECT(CN_ERROR_INVALID_DEVICE, "cnCtxCreate: no device %llu", (unsigned long long)dev);
    struct context *c = calloc(1, sizeof *c);
    c->token = next_context; next_context += 0x10;
    c->dev = dev; c->next = contexts; contexts = c;
    current_context = c->token; /* created contexts are bound to the caller */
    *pcontext = (CNcontext)c->token;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnCtxGetCurrent(CNcontext *pcontext) {
    ENTER();
    NEED_INIT();
    if (!pcontext) REJECT(CN_ERROR_INVALID_VALUE, "cnCtxGetCurrent: pcontext is NULL");
    *pcontext = (CNcontext)current_context;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnCtxSetCurrent(CNcontext context) {
    ENTER();
    NEED_INIT();
    if (context && !find_context((uintptr_t)context))
        REJECT(CN_CONTEXT_ERROR_INVALID, "cnCtxSetCurrent: %p is not a context", (void *)context);
    current_context = (uintptr_t)context;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemGetInfo(uint64_t *free_bytes, uint64_t *total_bytes) {
    ENTER();
    NEED_CONTEXT();
    if (!free_bytes || !total_bytes) REJECT(CN_ERROR_INVALID_VALUE, "cnMemGetInfo: NULL output");
    *total_bytes = capacity;
    *free_bytes = capacity - used;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemGetAllocationGranularity(uint64_t *gran, CNmemAllocationProp *prop, int32_t option) {
    ENTER();
    NEED_CONTEXT();
    if (!gran) REJECT(CN_ERROR_INVALID_VALUE, "cnMemGetAllocationGranularity: granularity output is NULL");
    if (!check_prop(prop)) LEAVE(CN_ERROR_INVALID_VALUE);
    if (option != 0 && option != 1) REJECT(CN_ERROR_INVALID_VALUE, "granularity option=%d", option);
    *gran = granularity;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemAddressReserve(CNaddr *ptr, uint64_t size, uint64_t alignment, CNaddr start, uint64_t flags) {
    (void)start; /* a hint; the simulator places ranges where mmap does */
    ENTER();
    NEED_CONTEXT();
    if (!ptr) REJECT(CN_ERROR_INVALID_VALUE, "cnMemAddressReserve: ptr is NULL");
    if (!size || size % granularity)
        REJECT(CN_ERROR_INVALID_VALUE, "cnMemAddressReserve: size=%llu is not a positive multiple of %llu",
               (unsigned long long)size, (unsigned long long)granularity);
    if (alignment & (alignment - 1)) REJECT(CN_ERROR_INVALID_VALUE, "alignment=%llu",
                                            (unsigned long long)alignment);
    if (flags) REJECT(CN_ERROR_INVALID_VALUE, "cnMemAddressReserve: flags must be 0");
    struct range *r = calloc(1, sizeof *r);
    void *va = r ? reserve_aligned(size, alignment > granularity ? alignment : granularity) : NULL;
    if (!va) { free(r); REJECT(CN_OPS_ERROR_OUT_OF_RESOURCES, "cnMemAddressReserve: no address space"); }
    r->va = (uintptr_t)va; r->size = size; r->next = ranges; ranges = r;
    *ptr = (CNaddr)(uintptr_t)va;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemAddressFree(CNaddr ptr, uint64_t size) {
    ENTER();
    NEED_CONTEXT();
    struct range **link = &ranges;
    while (*link && (*link)->va != ptr) link = &(*link)->next;
    struct range *r = *link;
    if (!r) REJECT(CN_MEMORY_ERROR_INVALID_ADDRESS, "cnMemAddressFree: %#llx is not a reservation",
                   (unsigned long long)ptr);
    if (r->size != size)
        REJECT(CN_ERROR_INVALID_VALUE, "cnMemAddressFree: size=%llu differs from the reserved %zu",
               (unsigned long long)size, r->size);
    if (mapping_overlapping(r->va, r->va + r->size))
        REJECT(CN_ERROR_INVALID_VALUE, "cnMemAddressFree: the range still has mappings");
    munmap((void *)r->va, r->size);
    *link = r->next;
    free(r);
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemCreate(CNmemGenericAllocationHandle *handle, uint64_t size, CNmemAllocationProp *prop,
                            uint64_t flags) {
    ENTER();
    NEED_CONTEXT();
    if (!handle) REJECT(CN_ERROR_INVALID_VALUE, "cnMemCreate: handle is NULL");
    if (!check_prop(prop)) LEAVE(CN_ERROR_INVALID_VALUE);
    if (flags) REJECT(CN_ERROR_INVALID_VALUE, "cnMemCreate: flags must be 0");
    if (!size || size % granularity)
        REJECT(CN_ERROR_INVALID_VALUE, "cnMemCreate: size=%llu is not a positive multiple of %llu",
               (unsigned long long)size, (unsigned long long)granularity);
    if (size > capacity - used)
        REJECT(CN_MEMORY_ERROR_OUT_OF_MEMORY, "cnMemCreate: %llu bytes requested, %llu free",
               (unsigned long long)size, (unsigned long long)(capacity - used));
    int fd = memfd_create("cndrv-sim-chunk", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        REJECT(CN_MEMORY_ERROR_OUT_OF_MEMORY, "cnMemCreate: memfd failed");
    }
    struct chunk *c = calloc(1, sizeof *c);
    c->id = next_handle++; c->fd = fd; c->size = size; c->device = prop->location.id;
    c->next = chunks; chunks = c;
    used += size;
    *handle = c->id;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemRelease(CNmemGenericAllocationHandle handle) {
    ENTER();
    NEED_CONTEXT();
    struct chunk *c = find_chunk(handle);
    if (!c) REJECT(CN_ERROR_INVALID_VALUE, "cnMemRelease: %#llx is not a live handle", (unsigned long long)handle);
    c->released = 1; /* still mapped: the memory goes with the last mapping */
    free_if_done(c);
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemMap(CNaddr ptr, uint64_t size, uint64_t offset, CNmemGenericAllocationHandle handle,
                         uint64_t flags) {
    ENTER();
    NEED_CONTEXT();
    struct chunk *c = find_chunk(handle);
    if (!c) REJECT(CN_ERROR_INVALID_VALUE, "cnMemMap: %#llx is not a live handle", (unsigned long long)handle);
    if (offset) REJECT(CN_ERROR_INVALID_VALUE, "cnMemMap: offset=%llu must be 0", (unsigned long long)offset);
    if (flags) REJECT(CN_ERROR_INVALID_VALUE, "cnMemMap: flags must be 0");
    if (size != c->size)
        REJECT(CN_ERROR_INVALID_VALUE, "cnMemMap: size=%llu differs from the physical size %zu",
               (unsigned long long)size, c->size);
    if (ptr % granularity) REJECT(CN_ERROR_INVALID_VALUE, "cnMemMap: %#llx is not aligned", (unsigned long long)ptr);
    if (!range_containing(ptr, size)) REJECT(CN_MEMORY_ERROR_INVALID_ADDRESS, "cnMemMap: not inside a reservation");
    if (mapping_overlapping(ptr, ptr + size)) REJECT(CN_ERROR_INVALID_VALUE, "cnMemMap: overlaps a mapping");
    /* inaccessible until cnMemSetAccess */
    if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, c->fd, 0) == MAP_FAILED)
        REJECT(CN_MEMORY_ERROR_OUT_OF_MEMORY, "cnMemMap: mmap failed");
    struct mapping *m = calloc(1, sizeof *m);
    m->va = ptr; m->size = size; m->chunk = c; m->next = mappings; mappings = m;
    c->maps++;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemSetAccess(CNaddr ptr, uint64_t size, CNmemAccessDesc *desc, uint64_t count) {
    ENTER();
    NEED_CONTEXT();
    if (!desc) REJECT(CN_ERROR_INVALID_VALUE, "cnMemSetAccess: no descriptor");
    if (count != 1) REJECT(CN_ERROR_INVALID_VALUE, "cnMemSetAccess: count=%llu must be 1", (unsigned long long)count);
    if (!check_location(&desc->location, "cnMemSetAccess desc")) LEAVE(CN_ERROR_INVALID_VALUE);
    int prot = PROT_READ | PROT_WRITE;
    if (desc->accessFlags == PROT_READONLY_FLAG) prot = PROT_READ;
    else if (desc->accessFlags != PROT_READWRITE_FLAG)
        REJECT(CN_ERROR_INVALID_VALUE, "cnMemSetAccess: accessFlags=%d, expected READWRITE (0) or READONLY (1)",
               desc->accessFlags);
    if (desc->cacheType < 0 || desc->cacheType > 3 || desc->pinnedType < 0 || desc->pinnedType > 1)
        REJECT(CN_ERROR_INVALID_VALUE, "cnMemSetAccess: cacheType=%d (0-3) or pinnedType=%d (0-1) is not valid",
               desc->cacheType, desc->pinnedType);
    if (!covered_by_mappings(ptr, size))
        REJECT(CN_MEMORY_ERROR_INVALID_ADDRESS, "cnMemSetAccess: [%#llx, +%llu) is not mapped",
               (unsigned long long)ptr, (unsigned long long)size);
    for (uintptr_t at = ptr; at < ptr + size;) {
        struct mapping *m = mapping_at(at);
        if (m->chunk->device != desc->location.id)
            REJECT(CN_ERROR_INVALID_VALUE, "cnMemSetAccess: location.id=%u, but the memory at %#llx was created "
                   "on device %u", desc->location.id, (unsigned long long)at, m->chunk->device);
        at += m->size;
    }
    mprotect((void *)(uintptr_t)ptr, size, prot);
    set_access_calls++;
    LEAVE(CN_SUCCESS);
}

EXPORT CNresult cnMemUnmap(CNaddr ptr, uint64_t size) {
    ENTER();
    NEED_CONTEXT();
    if (!covered_by_mappings(ptr, size))
        REJECT(mapping_overlapping(ptr, ptr + size) ? CN_ERROR_INVALID_VALUE : CN_MEMORY_ERROR_INVALID_ADDRESS,
               "cnMemUnmap: [%#llx, +%llu) is not a run of whole mappings",
               (unsigned long long)ptr, (unsigned long long)size);
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    for (uintptr_t at = ptr; at < ptr + size;) {
        struct mapping **link = &mappings;
        while ((*link)->va != at) link = &(*link)->next;
        struct mapping *m = *link;
        at += m->size;
        m->chunk->maps--;
        free_if_done(m->chunk);
        *link = m->next;
        free(m);
    }
    LEAVE(CN_SUCCESS);
}

/* ------------------------------------------------------ simulator controls */

/* Set capacity, granularity and device count; refused once something is allocated. */
EXPORT int cndrv_sim_configure(uint64_t cap, uint64_t gran, uint32_t ndev) {
    ENTER();
    if (chunks || ranges || !gran || gran % (uint64_t)sysconf(_SC_PAGESIZE) || !ndev)
        REJECT(CN_ERROR_INVALID_VALUE, "cndrv_sim_configure: busy or bad values");
    capacity = cap; granularity = gran; devices = ndev;
    LEAVE(CN_SUCCESS);
}

/* Live objects and counters: "ranges", "chunks" (not released), "mappings", "used", "set_access", "init",
   "contexts" (created). */
EXPORT uint64_t cndrv_sim_count(const char *what) {
    uint64_t n = 0;
    ENTER();
    if (!strcmp(what, "ranges")) for (struct range *r = ranges; r; r = r->next) n++;
    else if (!strcmp(what, "chunks")) for (struct chunk *c = chunks; c; c = c->next) n += !c->released;
    else if (!strcmp(what, "contexts")) for (struct context *c = contexts; c; c = c->next) n++;
    else if (!strcmp(what, "mappings")) for (struct mapping *m = mappings; m; m = m->next) n++;
    else if (!strcmp(what, "used")) n = used;
    else if (!strcmp(what, "set_access")) n = set_access_calls;
    else if (!strcmp(what, "init")) n = init_calls;
    LEAVE(n);
}

/* Why the last call of this thread was rejected ("" when none was). */
EXPORT const char *cndrv_sim_last_error(void) { return last_error; }
