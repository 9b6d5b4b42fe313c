/* A stub libcuda.so.1 for running Triton's own CUDA driver module and C launcher on a CPU.
 *
 * The entry points Triton's driver.c and its launchers call (triton 3.6 and 3.9) answer as one
 * sm_90 device would, except that nothing runs: cuModuleLoadData keeps the cubin,
 * cuModuleGetFunction reads the kernel's parameter offsets and sizes from the cubin's
 * .nv.info.<kernel> section (EIATTR_KPARAM_INFO, what the real driver reads), and
 * cuLaunchKernelEx copies each kernel parameter into a record the test reads back
 * (stub_launch_count / stub_launch) instead of launching. cuPointerGetAttribute answers every
 * address as device memory, so CPU tensors pass the launcher's pointer check.
 *
 * Built by tests/launch_path/stub.py (its docstring has the gcc command), against Triton's bundled
 * cuda.h so each name gets the symbol the launcher links to.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"

#define STUB_MAX_PARAMS 128
#define STUB_MAX_BYTES 4096

typedef struct {
  char name[256];
  int num_params;
  uint16_t offsets[STUB_MAX_PARAMS];
  uint16_t sizes[STUB_MAX_PARAMS];
  int max_threads;
} StubFunction;

typedef struct {
  char name[256];
  uint32_t grid[3];
  uint32_t block[3];
  uint32_t shared;
  uint64_t stream;
  uint32_t num_attrs;
  int32_t num_params;
  uint16_t offsets[STUB_MAX_PARAMS];
  uint16_t sizes[STUB_MAX_PARAMS];
  uint32_t block_size;
  uint8_t bytes[STUB_MAX_BYTES];
} StubLaunch;

typedef struct {
  uint8_t *image;
  size_t size;
} StubModule;

static StubLaunch *launches = NULL;
static int64_t launch_count = 0, launch_capacity = 0;
static int context_token = 1;

/* ------------------------------------------------------------------ read back by the tests */
int64_t stub_launch_count(void) { return launch_count; }
const StubLaunch *stub_launch(int64_t i) { return (i >= 0 && i < launch_count) ? &launches[i] : NULL; }
void stub_reset(void) { launch_count = 0; }
size_t stub_record_size(void) { return sizeof(StubLaunch); }

/* ------------------------------------------------------------------ the cubin's parameter table */
static size_t elf_size(const uint8_t *image) {
  uint64_t shoff;
  uint16_t shentsize, shnum;
  memcpy(&shoff, image + 0x28, 8);
  memcpy(&shentsize, image + 0x3A, 2);
  memcpy(&shnum, image + 0x3C, 2);
  return shoff + (size_t)shentsize * shnum;
}

/* Fills f's offsets and sizes from .nv.info.<name>; returns 0 on success. */
static int read_params(const uint8_t *image, const char *name, StubFunction *f) {
  uint64_t shoff;
  uint16_t shentsize, shnum, shstrndx;
  memcpy(&shoff, image + 0x28, 8);
  memcpy(&shentsize, image + 0x3A, 2);
  memcpy(&shnum, image + 0x3C, 2);
  memcpy(&shstrndx, image + 0x3E, 2);
  uint64_t strtab;
  memcpy(&strtab, image + shoff + (size_t)shstrndx * shentsize + 24, 8);
  char wanted[300];
  snprintf(wanted, sizeof wanted, ".nv.info.%s", name);
  f->num_params = 0;
  for (uint16_t s = 0; s < shnum; s++) {
    const uint8_t *sh = image + shoff + (size_t)s * shentsize;
    uint32_t sh_name;
    uint64_t offset, size;
    memcpy(&sh_name, sh, 4);
    memcpy(&offset, sh + 24, 8);
    memcpy(&size, sh + 32, 8);
    if (strcmp((const char *)image + strtab + sh_name, wanted) != 0)
      continue;
    /* Entries: u8 format, u8 attribute, u16 value or (format 4, EIFMT_SVAL) payload size. */
    for (uint64_t at = 0; at + 4 <= size;) {
      const uint8_t *e = image + offset + at;
      uint8_t format = e[0], attribute = e[1];
      uint16_t value;
      memcpy(&value, e + 2, 2);
      at += 4;
      if (format != 0x04)
        continue;
      if (attribute == 0x17 && value >= 12) { /* EIATTR_KPARAM_INFO */
        uint16_t ordinal, param_offset;
        uint32_t packed;
        memcpy(&ordinal, e + 8, 2);
        memcpy(&param_offset, e + 10, 2);
        memcpy(&packed, e + 12, 4);
        if (ordinal >= STUB_MAX_PARAMS)
          return -1;
        f->offsets[ordinal] = param_offset;
        f->sizes[ordinal] = (packed >> 18) & 0x3fff;
        if (ordinal + 1 > f->num_params)
          f->num_params = ordinal + 1;
      }
      at += value;
    }
    return 0;
  }
  return -1;
}

/* ------------------------------------------------------------------ the driver API */
CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *version) { *version = 12080; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return ordinal == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }

CUresult cuGetErrorString(CUresult error, const char **str) {
  *str = error == CUDA_SUCCESS ? "no error (stub libcuda)" : "error (stub libcuda)";
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  switch (attribute) {
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
  case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 232448; break;
  case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *value = 49152; break;
  case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = 65536; break;
  case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 132; break;
  case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
  case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *value = 1980000; break;
  case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *value = 2619000; break;
  case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = 5120; break;
  case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
  default: *value = 0; break;
  }
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) { *ctx = (CUcontext)&context_token; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext ctx) { return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) { *ctx = (CUcontext)&context_token; return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) { *value = 1 << 20; return CUDA_SUCCESS; }
CUresult cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  const uint8_t *bytes = image;
  if (memcmp(bytes, "\x7f" "ELF", 4) != 0)
    return CUDA_ERROR_INVALID_IMAGE;
  StubModule *m = malloc(sizeof *m);
  m->size = elf_size(bytes);
  m->image = malloc(m->size);
  memcpy(m->image, bytes, m->size);
  *module = (CUmodule)m;
  return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule module) {
  StubModule *m = (StubModule *)module;
  free(m->image);
  free(m);
  return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
  StubModule *m = (StubModule *)module;
  StubFunction *f = calloc(1, sizeof *f);
  strncpy(f->name, name, sizeof f->name - 1);
  f->max_threads = 1024;
  if (read_params(m->image, name, f) != 0) {
    free(f);
    return CUDA_ERROR_NOT_FOUND;
  }
  *function = (CUfunction)f;
  return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction function) {
  switch (attribute) {
  case CU_FUNC_ATTRIBUTE_NUM_REGS: *value = 32; break;
  case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = ((StubFunction *)function)->max_threads; break;
  default: *value = 0; break; /* LOCAL_SIZE_BYTES (spills), SHARED_SIZE_BYTES, ... */
  }
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction function, CUfunction_attribute attribute, int value) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction function, CUfunc_cache config) { return CUDA_SUCCESS; }

CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  switch (attribute) {
  case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; return CUDA_SUCCESS;
  case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; return CUDA_SUCCESS;
  case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = 0; return CUDA_SUCCESS;
  default: return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult cuPointerGetAttributes(unsigned int count, CUpointer_attribute *attributes, void **data, CUdeviceptr ptr) {
  for (unsigned int i = 0; i < count; i++)
    if (cuPointerGetAttribute(data[i], attributes[i], ptr) != CUDA_SUCCESS)
      return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxActiveClusters(int *num, CUfunction function, const CUlaunchConfig *config) {
  *num = 1;
  return CUDA_SUCCESS;
}

CUresult cuTensorMapEncodeTiled(CUtensorMap *map, CUtensorMapDataType t, cuuint32_t rank, void *address,
                                const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
                                const cuuint32_t *element_strides, CUtensorMapInterleave interleave,
                                CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion,
                                CUtensorMapFloatOOBfill fill) {
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction function, void **params, void **extra) {
  StubFunction *f = (StubFunction *)function;
  if (params == NULL || extra != NULL)
    return CUDA_ERROR_INVALID_VALUE;
  if (launch_count == launch_capacity) {
    launch_capacity = launch_capacity ? 2 * launch_capacity : 64;
    launches = realloc(launches, launch_capacity * sizeof *launches);
  }
  StubLaunch *r = &launches[launch_count];
  memset(r, 0, sizeof *r);
  memcpy(r->name, f->name, sizeof r->name);
  r->grid[0] = config->gridDimX, r->grid[1] = config->gridDimY, r->grid[2] = config->gridDimZ;
  r->block[0] = config->blockDimX, r->block[1] = config->blockDimY, r->block[2] = config->blockDimZ;
  r->shared = config->sharedMemBytes;
  r->stream = (uint64_t)(uintptr_t)config->hStream;
  r->num_attrs = config->numAttrs;
  r->num_params = f->num_params;
  for (int i = 0; i < f->num_params; i++) {
    r->offsets[i] = f->offsets[i];
    r->sizes[i] = f->sizes[i];
    if ((uint32_t)f->offsets[i] + f->sizes[i] > STUB_MAX_BYTES)
      return CUDA_ERROR_INVALID_VALUE;
    memcpy(r->bytes + f->offsets[i], params[i], f->sizes[i]);
    if ((uint32_t)f->offsets[i] + f->sizes[i] > r->block_size)
      r->block_size = f->offsets[i] + f->sizes[i];
  }
  launch_count++;
  return CUDA_SUCCESS;
}
