"""Triton's file cache, with a full disk reported as `jit.disk_full` instead of a bare OSError.

A cold start compiles our Triton kernels and SGLang's into TRITON_CACHE_DIR; a disk that fills half-way
fails inside Triton's `FileCacheManager.put` with `OSError: [Errno 28] No space left on device`, in a
scheduler process, under a compiler traceback. Triton's own hook for the cache class is
`TRITON_CACHE_MANAGER=module:Class` (triton/knobs.py `cache.manager_class`, read at each lookup); the
bootstrap sets it to `DiskFullClearCacheManager` when the patch is on and the user has not chosen one.
The class is Triton's file cache unchanged except that a write failing for lack of space raises
`jitcache.JitCacheFull` naming the kernel file, the directory, the free space and the fix.

Imported by Triton (when it resolves the variable), never by the gate: it imports Triton.
"""

from __future__ import annotations

from triton.runtime.cache import FileCacheManager

from .jitcache import disk_full, disk_full_error


class DiskFullClearCacheManager(FileCacheManager):
    def put(self, data, filename, binary=True) -> str:
        try:
            return super().put(data, filename, binary)
        except Exception as e:
            if not disk_full(e):
                raise
            raise disk_full_error(f"writing Triton kernel file {filename!r}", self.cache_dir or "?",
                                  "TRITON_CACHE_DIR (and TVM_FFI_CACHE_DIR)", e) from e
