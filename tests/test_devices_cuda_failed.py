"""A CUDA backend that did not start: `run` never trains on the CPU devices JAX offers
instead, and its E-DEV-001 says why (doctor's reading), single node or one node of several."""

import pytest

import sexpgpu.devices.doctor as doctor
import sexpgpu.run.backend as devices
from sexpgpu.errors import SxError


class _Cpu:
  platform = "cpu"
  process_index = 0
  id = 0


class _Nodes:
  nodes = 2


def _raises(msg):
  def devices_(kind=None):
    raise RuntimeError(msg)
  return devices_


@pytest.fixture
def plugin(monkeypatch):
  """The CUDA plugin installed, with the driver new enough."""
  monkeypatch.setattr(doctor, "_plugin", lambda: "jax_plugins.xla_cuda13")
  monkeypatch.setattr(doctor, "driver_version", lambda: "580.65.06")


def test_a_node_whose_backend_raised_is_e_dev_001_with_its_cause(monkeypatch, plugin):
  import jax
  monkeypatch.setattr(jax, "devices", _raises(
      "Unable to initialize backend 'cuda': INTERNAL: CUDA error: "
      "CUDA_ERROR_INSUFFICIENT_DRIVER (you may need to uninstall the failing plugin package)"))
  with pytest.raises(SxError) as e:
    devices.open_devices("cuda", None, _Nodes())
  err = e.value
  assert err.code == "E-DEV-001"
  assert err.message.startswith("the cuda devices cannot be opened on this node: the NVIDIA "
                                "driver is too old for the plugin's CUDA (Unable to initialize")
  assert err.fix.startswith(doctor.FIX_DRIVER)


def test_a_node_offered_cpu_devices_names_the_library_missing(monkeypatch, plugin, tmp_path):
  import jax
  node = tmp_path / "nvidiactl"
  node.write_text("")
  monkeypatch.setattr(doctor, "DEVICE_NODES", (str(node),))
  monkeypatch.setattr(doctor, "_load",
                      lambda stem: (None, None) if stem == "libcufft" else (object(), stem))
  monkeypatch.setattr(jax, "devices", lambda kind=None: [_Cpu()])
  with pytest.raises(SxError) as e:
    devices.open_devices("cuda", None, _Nodes())
  err = e.value
  assert err.code == "E-DEV-001" and err.message == (
      "the cuda devices cannot be opened on this node: JAX offers cpu devices instead; "
      "the CUDA libraries libcufft cannot be loaded")
  assert err.fix.startswith(doctor.FIX_LIBRARY)


def test_one_node_says_why_too(monkeypatch, plugin):
  import jax
  monkeypatch.setattr(jax, "devices", _raises(
      "Unable to initialize backend 'cuda': INTERNAL: no CUDA-capable device is detected"))
  with pytest.raises(SxError) as e:
    devices.open_device("cuda")
  assert e.value.code == "E-DEV-001" and "CUDA finds no GPU" in e.value.message
  assert e.value.fix.startswith(doctor.FIX_VISIBLE)


def test_without_the_plugin_the_fix_installs_it(monkeypatch):
  import jax
  monkeypatch.setattr(doctor, "_plugin", lambda: None)
  monkeypatch.setattr(doctor, "driver_version", lambda: None)
  monkeypatch.setattr(jax, "devices", _raises("Unknown backend cuda"))
  with pytest.raises(SxError) as e:
    devices.open_device("cuda")
  assert "the jax_cuda13 plugin is not installed" in e.value.message
  assert e.value.fix.startswith('pip install "sexpgpu[cuda]"')
