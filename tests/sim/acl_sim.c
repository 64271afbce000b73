/*
 * acl_sim.c -- a host-memory simulator of the VMM part of libascendcl (acl_rt.h).
 *
 * Exports the prototypes, struct layouts and enum values of the Ascend runtime
 * (acl_rt.h) and enforces the rules its documentation gives:
 *
 *   - the CANN version (ACL_SIM_CANN_VERSION, default "8.3.RC1"; "" makes
 *     aclsysGetCANNVersion fail) decides what is valid, as the CANN docs of
 *     that version say;
 *   - aclrtPhysicalMemProp: handleType NONE (0), allocationType PINNED (0),
 *     memAttr HBM_MEM_HUGE (4) or HBM_MEM_HUGE1G (10), also HBM_MEM_NORMAL (5)
 *     on CANN 7-8 and MEM_NORMAL/HUGE/HUGE1G (12-14) on CANN 9, location
 *     {id, type} with type DEVICE (1), padding zero; reserve may hold anything;
 *   - aclrtReserveMemAddress: alignment 0; flags 0 or 1 (the page type) up to
 *     CANN 8, 0 (reserved) from CANN 9;
 *   - aclrtMapMem: offset 0, flags 0, size equal to the physical size, inside a
 *     reservation, aligned, no overlap; memory is accessible right after it;
 *   - aclrtUnmapMem(va): one call per mapping, va must start a mapping;
 *   - aclrtMemSetAccess (left out when built with -DACL_SIM_NO_SET_ACCESS):
 *     flags READWRITE (3), location {id, DEVICE}, rsv zero, exactly one mapping;
 *   - memory calls need aclrtSetDevice on the calling thread (ACL_ERROR_RT_CONTEXT_NULL);
 *   - allocations past the capacity fail with ACL_ERROR_RT_MEMORY_ALLOCATION.
 *
 * A physical handle is a memfd; a mapping is mmap(MAP_SHARED | MAP_FIXED) of it
 * into a PROT_NONE reservation, so two mappings of one handle really alias.
 *
 * Configuration, read at first use: ACL_SIM_CAPACITY (bytes, default 16 GiB),
 * ACL_SIM_GRANULARITY (bytes, default 2 MiB), ACL_SIM_DEVICES (default 1); or
 * acl_sim_configure() before anything is allocated; acl_sim_set_cann_version().
 * acl_sim_count() and aclGetRecentErrMsg() let tests look inside.
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

typedef int aclError;
typedef void *aclrtDrvMemHandle;

typedef struct { uint32_t id; int32_t type; } aclrtMemLocation;
typedef struct {
    int32_t handleType;
    int32_t allocationType;
    int32_t memAttr;
    aclrtMemLocation location;
    uint64_t reserve;
} aclrtPhysicalMemProp;
typedef struct { int32_t flags; aclrtMemLocation location; uint8_t rsv[12]; } aclrtMemAccessDesc;

_Static_assert(sizeof(aclrtPhysicalMemProp) == 32, "aclrtPhysicalMemProp is 32 bytes");
_Static_assert(offsetof(aclrtPhysicalMemProp, location) == 12, "location at 12");
_Static_assert(offsetof(aclrtPhysicalMemProp, reserve) == 24, "reserve at 24");
_Static_assert(sizeof(aclrtMemAccessDesc) == 24, "aclrtMemAccessDesc is 24 bytes");

typedef struct {
    char version[128];
    char majorVersion[64];
    char minorVersion[64];
    char releaseVersion[64];
    char patchVersion[64];
    char reserved[128];
} aclCANNPackageVersion;

_Static_assert(sizeof(aclCANNPackageVersion) == 512, "aclCANNPackageVersion is 512 bytes");

enum {
    ACL_SUCCESS = 0,
    ACL_ERROR_REPEAT_INITIALIZE = 100002,
    ACL_ERROR_RT_PARAM_INVALID = 107000,
    ACL_ERROR_RT_INVALID_DEVICEID = 107001,
    ACL_ERROR_RT_CONTEXT_NULL = 107002,
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000,
    ACL_ERROR_RT_MEMORY_ALLOCATION = 207001,
};
enum { LOC_DEVICE = 1, HANDLE_NONE = 0, ALLOC_PINNED = 0, HBM_MEM_HUGE = 4, HBM_MEM_NORMAL = 5,
       HBM_MEM_HUGE1G = 10, MEM_NORMAL = 12, MEM_HUGE = 13, MEM_HUGE1G = 14 };
enum { ACL_DDR_MEM = 0, ACL_HBM_MEM = 1, ACCESS_READWRITE = 3 };

struct chunk { struct chunk *next; uintptr_t token; int fd; size_t size; int maps; };
struct range { struct range *next; uintptr_t va; size_t size; };
struct mapping { struct mapping *next; uintptr_t va; size_t size; struct chunk *chunk; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int configured, initialized;
static __thread int32_t current_device = -1; /* ACL binds a device to each thread */
static uint64_t capacity, granularity, used, set_access_calls, last_reserve_flags;
static char cann_version[128];
static uintptr_t next_token = 0xac1000000010ULL; /* handles are opaque tokens, never reused */
static uint32_t devices;
static struct chunk *chunks;
static struct range *ranges;
static struct mapping *mappings;
static __thread char recent[256];

static uint64_t env_u64(const char *name, uint64_t fallback) {
    const char *text = getenv(name);
    return text && *text ? strtoull(text, NULL, 0) : fallback;
}

static void configure_once(void) {
    if (configured) return;
    capacity = env_u64("ACL_SIM_CAPACITY", 16ULL << 30);
    granularity = env_u64("ACL_SIM_GRANULARITY", 2ULL << 20);
    devices = (uint32_t)env_u64("ACL_SIM_DEVICES", 1);
    const char *version = getenv("ACL_SIM_CANN_VERSION");
    snprintf(cann_version, sizeof cann_version, "%s", version ? version : "8.3.RC1");
    configured = 1;
}

#define ENTER() pthread_mutex_lock(&lock); configure_once()
#define LEAVE(rc) do { pthread_mutex_unlock(&lock); return (rc); } while (0)
/* Reject a call: remember why (aclGetRecentErrMsg) and return the code. */
#define REJECT(code, ...) do { snprintf(recent, sizeof recent, __VA_ARGS__); LEAVE(code); } while (0)
#define NEED_DEVICE() do { if (current_device < 0) \
    REJECT(ACL_ERROR_RT_CONTEXT_NULL, "%s: no device set on this thread (aclrtSetDevice)", __func__); } while (0)

static int check_location(const aclrtMemLocation *loc, const char *what) {
    if (loc->type != LOC_DEVICE) {
        snprintf(recent, sizeof recent, "%s: location.type=%d at offset +4 is not DEVICE (1); "
                 "the ACL location is {id, type}", what, loc->type);
        return 0;
    }
    if (loc->id >= devices) {
        snprintf(recent, sizeof recent, "%s: location.id=%u is not a device (have %u)", what, loc->id, devices);
        return 0;
    }
    return 1;
}

/* The CANN major version; an unknown one counts as 8 (the last that documents reserve flags). */
static int cann_major(void) { return cann_version[0] ? atoi(cann_version) : 8; }

static int valid_mem_attr(int32_t attr) {
    if (attr == HBM_MEM_HUGE || attr == HBM_MEM_HUGE1G) return 1;
    if (cann_major() <= 8) return attr == HBM_MEM_NORMAL;
    return attr == MEM_NORMAL || attr == MEM_HUGE || attr == MEM_HUGE1G;
}

static int check_prop(const aclrtPhysicalMemProp *p) {
    const uint8_t *raw = (const uint8_t *)p;
    if (!p) { snprintf(recent, sizeof recent, "prop is NULL"); return 0; }
    if (p->handleType != HANDLE_NONE) {
        snprintf(recent, sizeof recent, "prop.handleType=%d, expected NONE (0)", p->handleType); return 0;
    }
    if (p->allocationType != ALLOC_PINNED) {
        snprintf(recent, sizeof recent, "prop.allocationType=%d, expected PINNED (0)", p->allocationType); return 0;
    }
    if (!valid_mem_attr(p->memAttr)) {
        snprintf(recent, sizeof recent, "prop.memAttr=%d is not a memory type of CANN %s", p->memAttr,
                 cann_version[0] ? cann_version : "(unknown)");
        return 0;
    }
    if (!check_location(&p->location, "prop")) return 0;
    for (size_t i = 20; i < offsetof(aclrtPhysicalMemProp, reserve); i++)
        if (raw[i]) { snprintf(recent, sizeof recent, "prop: byte %zu (padding) is not zero", i); return 0; }
    return 1;
}

static struct chunk *find_chunk(const void *handle) {
    for (struct chunk *c = chunks; c; c = c->next) if (c->token == (uintptr_t)handle) return c;
    return NULL;
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

__attribute__((unused)) static struct mapping *mapping_at(uintptr_t va) {
    for (struct mapping *m = mappings; m; m = m->next) if (m->va == va) return m;
    return NULL;
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

/* ------------------------------------------------------------------ ACL API */

EXPORT aclError aclInit(const char *configPath) {
    (void)configPath;
    ENTER();
    if (initialized) REJECT(ACL_ERROR_REPEAT_INITIALIZE, "aclInit: already initialized");
    initialized = 1;
    LEAVE(ACL_SUCCESS);
}

EXPORT const char *aclGetRecentErrMsg(void) {
    static __thread char copy[sizeof recent];
    if (!recent[0]) return NULL;
    memcpy(copy, recent, sizeof copy);
    recent[0] = 0;
    return copy;
}

EXPORT aclError aclsysGetCANNVersion(int32_t name, aclCANNPackageVersion *version) {
    ENTER();
    if (!version) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclsysGetCANNVersion: version is NULL");
    if (name < 0 || name > 7) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclsysGetCANNVersion: package name=%d", name);
    if (!cann_version[0]) REJECT(ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "aclsysGetCANNVersion: no version information");
    memset(version, 0, sizeof *version);
    snprintf(version->version, sizeof version->version, "%s", cann_version);
    snprintf(version->majorVersion, sizeof version->majorVersion, "%d", cann_major());
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtGetDeviceCount(uint32_t *count) {
    ENTER();
    if (!count) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtGetDeviceCount: count is NULL");
    *count = devices;
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtSetDevice(int32_t deviceId) {
    ENTER();
    if (deviceId < 0 || (uint32_t)deviceId >= devices)
        REJECT(ACL_ERROR_RT_INVALID_DEVICEID, "aclrtSetDevice: no device %d (have %u)", deviceId, devices);
    current_device = deviceId;
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtGetDevice(int32_t *deviceId) {
    ENTER();
    if (!deviceId) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtGetDevice: deviceId is NULL");
    if (current_device < 0) REJECT(ACL_ERROR_RT_CONTEXT_NULL, "aclrtGetDevice: no device set");
    *deviceId = current_device;
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtGetMemInfo(int32_t attr, size_t *free_bytes, size_t *total_bytes) {
    ENTER();
    NEED_DEVICE();
    if (!free_bytes || !total_bytes) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtGetMemInfo: NULL output");
    if (attr == ACL_HBM_MEM) { *total_bytes = capacity; *free_bytes = capacity - used; }
    else if (attr == ACL_DDR_MEM) { *total_bytes = 0; *free_bytes = 0; }
    else REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtGetMemInfo: attr=%d is not DDR (0) or HBM (1)", attr);
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, int32_t option, size_t *gran) {
    ENTER();
    NEED_DEVICE();
    if (!check_prop(prop)) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
    if (option != 0 && option != 1) REJECT(ACL_ERROR_RT_PARAM_INVALID, "granularity option=%d", option);
    if (!gran) REJECT(ACL_ERROR_RT_PARAM_INVALID, "granularity output is NULL");
    *gran = granularity;
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                       uint64_t flags) {
    (void)expectPtr; /* a hint; the simulator places ranges where mmap does */
    ENTER();
    NEED_DEVICE();
    if (!virPtr) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: virPtr is NULL");
    if (!size || size % granularity)
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: size=%zu is not a positive multiple of %llu",
               size, (unsigned long long)granularity);
    if (alignment) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: alignment=%zu is reserved, must be 0",
                          alignment);
    if (cann_major() >= 9 ? flags != 0 : flags > 1)
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtReserveMemAddress: flags=%llu; CANN %s takes %s",
               (unsigned long long)flags, cann_version[0] ? cann_version : "(unknown)",
               cann_major() >= 9 ? "0 (reserved)" : "0 or 1 (the page type)");
    struct range *r = calloc(1, sizeof *r);
    void *va = r ? reserve_aligned(size, granularity) : NULL;
    if (!va) { free(r); REJECT(ACL_ERROR_RT_MEMORY_ALLOCATION, "no address space for %zu bytes", size); }
    r->va = (uintptr_t)va; r->size = size; r->next = ranges; ranges = r;
    last_reserve_flags = flags;
    *virPtr = va;
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtReleaseMemAddress(void *virPtr) {
    ENTER();
    NEED_DEVICE();
    struct range **link = &ranges;
    while (*link && (*link)->va != (uintptr_t)virPtr) link = &(*link)->next;
    struct range *r = *link;
    if (!r) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtReleaseMemAddress: %p is not a reservation", virPtr);
    if (mapping_overlapping(r->va, r->va + r->size))
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtReleaseMemAddress: %p still has mappings", virPtr);
    munmap((void *)r->va, r->size);
    *link = r->next;
    free(r);
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                                    uint64_t flags) {
    ENTER();
    NEED_DEVICE();
    if (!handle) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMallocPhysical: handle is NULL");
    if (!check_prop(prop)) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
    if (flags) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMallocPhysical: flags must be 0");
    if (!size || size % granularity)
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMallocPhysical: size=%zu is not a positive multiple of %llu",
               size, (unsigned long long)granularity);
    if (size > capacity - used)
        REJECT(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMallocPhysical: %zu bytes requested, %llu free", size,
               (unsigned long long)(capacity - used));
    int fd = memfd_create("acl-sim-chunk", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        REJECT(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMallocPhysical: memfd failed");
    }
    struct chunk *c = calloc(1, sizeof *c);
    c->token = next_token; next_token += 0x10;
    c->fd = fd; c->size = size; c->next = chunks; chunks = c;
    used += size;
    *handle = (void *)c->token;
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtFreePhysical(aclrtDrvMemHandle handle) {
    ENTER();
    NEED_DEVICE();
    struct chunk **link = &chunks;
    while (*link && (*link)->token != (uintptr_t)handle) link = &(*link)->next;
    struct chunk *c = *link;
    if (!c) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtFreePhysical: %p is not a live handle", handle);
    if (c->maps) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtFreePhysical: %p is still mapped %d time(s)",
                        handle, c->maps);
    close(c->fd);
    used -= c->size;
    *link = c->next;
    free(c);
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags) {
    ENTER();
    NEED_DEVICE();
    uintptr_t va = (uintptr_t)virPtr;
    struct chunk *c = find_chunk(handle);
    if (!c) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: %p is not a live handle", handle);
    if (offset) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: offset=%zu must be 0", offset);
    if (flags) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: flags must be 0");
    if (size != c->size)
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: size=%zu differs from the physical size %zu",
               size, c->size);
    if (va % granularity) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: %p is not aligned", virPtr);
    if (!range_containing(va, size))
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: [%p, +%zu) is not inside a reservation", virPtr, size);
    if (mapping_overlapping(va, va + size))
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMapMem: [%p, +%zu) overlaps a mapping", virPtr, size);
    if (mmap(virPtr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, c->fd, 0) == MAP_FAILED)
        REJECT(ACL_ERROR_RT_MEMORY_ALLOCATION, "aclrtMapMem: mmap failed");
    struct mapping *m = calloc(1, sizeof *m);
    m->va = va; m->size = size; m->chunk = c; m->next = mappings; mappings = m;
    c->maps++;
    LEAVE(ACL_SUCCESS);
}

EXPORT aclError aclrtUnmapMem(void *virPtr) {
    ENTER();
    NEED_DEVICE();
    struct mapping **link = &mappings;
    while (*link && (*link)->va != (uintptr_t)virPtr) link = &(*link)->next;
    struct mapping *m = *link;
    if (!m) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtUnmapMem: %p does not start a mapping", virPtr);
    mmap(virPtr, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    m->chunk->maps--;
    *link = m->next;
    free(m);
    LEAVE(ACL_SUCCESS);
}

#ifndef ACL_SIM_NO_SET_ACCESS
EXPORT aclError aclrtMemSetAccess(void *virPtr, size_t size, aclrtMemAccessDesc *desc, size_t count) {
    ENTER();
    NEED_DEVICE();
    if (!desc || !count) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemSetAccess: no descriptor");
    for (size_t i = 0; i < count; i++) {
        if (desc[i].flags != ACCESS_READWRITE)
            REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemSetAccess: desc.flags=%d, expected READWRITE (3)",
                   desc[i].flags);
        if (!check_location(&desc[i].location, "aclrtMemSetAccess desc")) LEAVE(ACL_ERROR_RT_PARAM_INVALID);
        for (size_t k = 0; k < sizeof desc[i].rsv; k++)
            if (desc[i].rsv[k]) REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemSetAccess: rsv is not zero");
    }
    struct mapping *m = mapping_at((uintptr_t)virPtr);
    if (!m || m->size != size)
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "aclrtMemSetAccess: [%p, +%zu) is not exactly one mapping", virPtr, size);
    set_access_calls++;
    LEAVE(ACL_SUCCESS);
}
#endif

/* ------------------------------------------------------ simulator controls */

/* Set capacity, granularity and device count; refused once something is allocated. */
EXPORT int acl_sim_configure(uint64_t cap, uint64_t gran, uint32_t ndev) {
    ENTER();
    if (chunks || ranges || !gran || gran % (uint64_t)sysconf(_SC_PAGESIZE) || !ndev)
        REJECT(ACL_ERROR_RT_PARAM_INVALID, "acl_sim_configure: busy or bad values");
    capacity = cap; granularity = gran; devices = ndev;
    LEAVE(ACL_SUCCESS);
}

/* The CANN version aclsysGetCANNVersion reports ("" makes it fail). */
EXPORT int acl_sim_set_cann_version(const char *version) {
    ENTER();
    snprintf(cann_version, sizeof cann_version, "%s", version ? version : "");
    LEAVE(ACL_SUCCESS);
}

/* Live objects and counters: "ranges", "chunks", "mappings", "used", "set_access", "init", and
   "reserve_flags" (the flags of the last successful aclrtReserveMemAddress). */
EXPORT uint64_t acl_sim_count(const char *what) {
    uint64_t n = 0;
    ENTER();
    if (!strcmp(what, "ranges")) for (struct range *r = ranges; r; r = r->next) n++;
    else if (!strcmp(what, "chunks")) for (struct chunk *c = chunks; c; c = c->next) n++;
    else if (!strcmp(what, "mappings")) for (struct mapping *m = mappings; m; m = m->next) n++;
    else if (!strcmp(what, "used")) n = used;
    else if (!strcmp(what, "set_access")) n = set_access_calls;
    else if (!strcmp(what, "init")) n = (uint64_t)initialized;
    else if (!strcmp(what, "reserve_flags")) n = last_reserve_flags;
    LEAVE(n);
}
