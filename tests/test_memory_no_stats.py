"""A GPU that reports no memory statistics: the plan refuses to plan against a guess (the
host's memory, as it once did) and names SEXPGPU_MEMORY; a device stands in for the GPU."""

import pytest

from sexpgpu.devices import memory
from sexpgpu.errors import SxError


class _Gpu:
  platform = "gpu"
  device_kind = "NVIDIA H100 80GB HBM3"
  id = 1

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    if isinstance(self.stats, Exception):
      raise self.stats
    return self.stats


@pytest.mark.parametrize("stats", [None, {}, {"bytes_in_use": 1 << 30},
                                   RuntimeError("UNIMPLEMENTED: memory_stats")])
def test_a_gpu_without_memory_stats_is_e_mem_002(stats):
  with pytest.raises(SxError) as e:
    memory.free_bytes_of(_Gpu(stats), None)
  err = e.value
  assert err.code == "E-MEM-002" and err.where == "the memory plan"
  assert "NVIDIA H100 80GB HBM3 (device 1) reports no memory statistics" in err.message
  assert "SEXPGPU_MEMORY=60GiB" in err.fix


def test_sexpgpu_memory_plans_such_a_gpu():
  assert memory.free_bytes_of(_Gpu(None), "60GiB") == 60 << 30


def test_a_gpu_with_stats_plans_against_its_limit():
  stats = {"bytes_limit": 60 << 30, "bytes_in_use": 2 << 30}
  assert memory.free_bytes_of(_Gpu(stats), None) == 58 << 30
