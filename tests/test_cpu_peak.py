"""The CPU's peak (MFU's denominator, lower/flops.py): measured with one executable, kept in
the run's cache folder by machine, and read back there without compiling or timing again."""

import json

import jax
import pytest

from sexpgpu.lower import flops


@pytest.fixture
def compiles(monkeypatch):
  """The XLA compiles (and persistent-cache loads) seen while the test runs."""
  seen = []

  def on(name, secs, **kw):
    if name == "/jax/core/compile/backend_compile_duration":
      seen.append(kw.get("fun_name"))
  jax.monitoring.register_event_duration_secs_listener(on)
  monkeypatch.setattr(flops, "_CPU_PEAK", None)
  yield seen
  jax.monitoring.unregister_event_duration_listener(on)


def test_measured_once_with_one_executable_then_read_from_the_cache(tmp_path, compiles):
  cpu = jax.devices("cpu")[0]
  peak = flops.device_peak(cpu, "f32", str(tmp_path))
  # the matmul alone (compiled or loaded: a cache hit passes the same event); its input is
  # put, not made on the device
  assert peak > 1e8 and len(compiles) == 1
  kept = json.loads((tmp_path / flops.PEAK_FILE).read_text())
  assert kept == {flops.machine_key(): peak}
  flops._CPU_PEAK = None  # a later process: the file's number, nothing compiled
  (tmp_path / flops.PEAK_FILE).write_text(json.dumps({**kept, flops.machine_key(): 1234.5}))
  assert flops.device_peak(cpu, "f32", str(tmp_path)) == 1234.5 and len(compiles) == 1


def test_another_machine_or_a_damaged_file_measures_again(tmp_path, compiles):
  cpu = jax.devices("cpu")[0]
  path = tmp_path / flops.PEAK_FILE
  path.write_text(json.dumps({"another machine": 99.0}))
  peak = flops.device_peak(cpu, "f32", str(tmp_path))
  assert peak != 99.0 and json.loads(path.read_text()) == {"another machine": 99.0,
                                                           flops.machine_key(): peak}
  flops._CPU_PEAK = None
  path.write_text("{not json")
  assert flops.device_peak(cpu, "f32", str(tmp_path)) > 1e8
  assert json.loads(path.read_text()) == {flops.machine_key(): flops._CPU_PEAK}


def test_the_key_names_the_machine_and_jax():
  key = flops.machine_key()
  assert f"jax {jax.__version__}" in key and "cores " in key and "XLA_FLAGS" in key
