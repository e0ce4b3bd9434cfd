"""What a run gives back to the OS before its loop (run/compile.py's release_freed_memory):
the heap's free pages, which glibc keeps otherwise."""

import subprocess
import sys

import pytest

# In a fresh process: 200 MB in chunks below glibc's mmap threshold, freed all but the last
# (so the heap's top is not free and glibc does not trim it by itself).
SCRIPT = """
import ctypes, ctypes.util
from sexpgpu.run.compile import release_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096 // (1 << 20)
chunks = [libc.malloc(100 << 10) for _ in range(2000)]
for c in chunks:
  ctypes.memset(c, 1, 100 << 10)
for c in chunks[:-1]:  # the last stays: the heap's top is not free
  libc.free(c)
before = rss()
ran = release_freed_memory()
print(ran, before, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_heaps_free_pages_go_back_to_the_os():
  out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  ran, before, after = out.stdout.split()
  assert ran == "True"
  assert int(before) - int(after) >= 150  # of the 200 MB freed


def test_a_long_compile_gives_back_what_it_freed_and_a_short_one_does_not(monkeypatch):
  import jax
  import jax.numpy as jnp

  from sexpgpu.run import compile as comp
  ran = []
  real = comp.release_freed_memory
  monkeypatch.setattr(comp, "release_freed_memory", lambda: ran.append(real()) or True)
  comp.release_after_compiles()
  comp.release_after_compiles()  # once a process: one listener
  monkeypatch.setattr(comp, "TRIM_AFTER_COMPILE_S", 1e9)
  jax.jit(lambda x: x * 3 + 1).lower(jax.ShapeDtypeStruct((5,), jnp.float32)).compile()
  assert ran == []
  monkeypatch.setattr(comp, "TRIM_AFTER_COMPILE_S", 0.0)
  jax.jit(lambda x: x * 5 - 2).lower(jax.ShapeDtypeStruct((7,), jnp.float32)).compile()
  assert ran == [True]
