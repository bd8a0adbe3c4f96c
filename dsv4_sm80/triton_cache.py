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

import shutil

from triton.runtime.cache import FileCacheManager

from .jitcache import MIN_FREE_BYTES, JitCacheFull, _disk_full, _nearest_existing, gib

class DiskFullClearCacheManager(FileCacheManager):
    def put(self, data, filename, binary=True) -> str:
        try:
            return super().put(data, filename, binary)
        except Exception as e:
            if not _disk_full(e):
                raise
            where = self.cache_dir or "?"
            try:
                free = shutil.disk_usage(_nearest_existing(where)).free
            except OSError:
                free = None
            raise JitCacheFull(
                f"dsv4-sm80 jit.disk_full: writing Triton kernel file {filename!r} failed: no space left on the "
                f"device of {where} ({gib(free)} free; a cold start needs about {gib(MIN_FREE_BYTES)}). Free "
                f"space there, or set TRITON_CACHE_DIR (and TVM_FFI_CACHE_DIR) to a disk with room, then "
                f"restart. Cause: {type(e).__name__}: {str(e)[-300:]}") from e
