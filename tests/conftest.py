"""Shared test setup: a private cache dir so tests never touch the user's."""

import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite compiles hundreds of small programs, and XLA's backend optimization (LLVM's
# passes) is half of each CPU compile: 7.9 s -> 3.8 s for tiny-lm's kernels. No test checks
# what it changes (the speed of the code, a last digit of a sum), so it is off here, for
# this process and the runs it starts; the benchmark test turns it back on (BENCH_XLA_FLAGS).
FAST_COMPILE = "--xla_backend_optimization_level=0"
# the flags as the user's runs have them: a pytest-xdist worker inherits the controller's
# XLA_FLAGS with FAST_COMPILE already in them, so it is taken out by name
BENCH_XLA_FLAGS = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                           if f != FAST_COMPILE)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (BENCH_XLA_FLAGS + " " + FAST_COMPILE).strip()
# A run's XLA CPU flag (run.backend.CPU_XLA_FLAGS: YNNPACK takes products only) as one
# compile's option, for tests that read what a run's compile makes: this process may have
# started its backend without it (XLA's default hands reductions to YNNPACK as well).
RUN_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


# A suite started under `nohup`, or as a background job of a script, inherits SIGHUP or
# SIGINT ignored; a run honours an ignored signal (as `nohup sexpgpu run` asks), so the tests
# that stop runs with them would wait for a stop that never comes. The suite undoes that for
# itself and the runs it starts (an ignored disposition is what a child inherits).
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
  signal.signal(signal.SIGHUP, signal.SIG_DFL)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
  """Each worker its own sexpgpu cache (choices, links), and one XLA cache for the whole
  session, shared by both workers and every run they start (JAX_COMPILATION_CACHE_DIR):
  most modules compile the same few smoke programs, and a compile is most of a short run."""
  os.environ.setdefault("SEXPGPU_CACHE_DIR", str(tmp_path_factory.mktemp("sexpgpu-cache")))
  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(shared / "xla-cache"))
  yield


# --- the tier holds every module ---------------------------------------------------------
# The quick loop (`pytest -m "not slow"`) and the whole suite each reach every module of
# sexpgpu/ from a test that ran. The package imports lazily (`import sexpgpu` loads one
# module, `sexpgpu.api` a dozen), so a module is counted when it was loaded in a test
# process (1) while a test ran, which is a test's code path, or (2) while a test file was
# being imported at collection, credited to that file only if at least one of its tests
# ran: a file whose tests are all slow credits nothing. Each xdist worker hands its record
# to the controller, which fails the session naming each module no test reached. It holds
# only when the whole tests/ directory ran (no file or -k; -m at most "not slow"; a
# --deselect only makes it stricter), since one module's tests are not meant to reach the
# others. Subprocess runs (the CLI started as a user does) are not counted.

def package_modules():
  """Every module of sexpgpu/ as a dotted name, read from the files (a new module counts)."""
  top = os.path.join(ROOT, "sexpgpu")
  names = set()
  for folder, dirs, files in os.walk(top):
    dirs[:] = [d for d in dirs if d != "__pycache__"]
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
        names.add(rel[:-len(".__init__")] if rel.endswith(".__init__") else rel)
  return names


def _loaded():
  return {m for m in sys.modules if m == "sexpgpu" or m.startswith("sexpgpu.")}


_REACH = {"by_file": {}, "collected": None, "ran": set(), "workers": []}


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
  """Which modules importing each test file loaded first (credited if one of its tests ran)."""
  if not isinstance(collector, pytest.Module):
    return (yield)
  before = _loaded()
  try:
    return (yield)
  finally:
    _REACH["by_file"][collector.nodeid] = sorted(_loaded() - before)


def pytest_collection_finish(session):
  """What collection loaded, so that what a test loads later is told apart."""
  _REACH["collected"] = _loaded()


def pytest_runtest_logreport(report):
  """A test file counts once one of its tests has run (passed or failed, not skipped)."""
  if report.when == "call" and not report.skipped:
    _REACH["ran"].add(report.nodeid.split("::")[0])


def _reached():
  """The modules this process's tests reached, as in the comment above."""
  out = _loaded() - (_REACH["collected"] or set())
  for nodeid, mods in _REACH["by_file"].items():
    if nodeid in _REACH["ran"]:
      out.update(mods)
  return out


def _whole_tier(config):
  """Whether this session is the whole suite or the not-slow tier (deselections allowed)."""
  opt = config.option
  return (config.args_source == pytest.Config.ArgsSource.TESTPATHS
          and not getattr(opt, "keyword", "") and getattr(opt, "markexpr", "") in ("", "not slow")
          and not getattr(opt, "lf", False) and not getattr(opt, "exitfirst", False)
          and not getattr(opt, "collectonly", False))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  """(xdist controller) the modules a worker's tests reached."""
  _REACH["workers"].append(set(getattr(node, "workeroutput", {}).get("sexpgpu_reached", ())))


def pytest_sessionfinish(session, exitstatus):
  """A worker hands over the modules its tests reached; the controller (or a lone process)
  fails the session naming each module of sexpgpu/ that no test reached."""
  config = session.config
  if hasattr(config, "workeroutput"):
    config.workeroutput["sexpgpu_reached"] = sorted(_reached())
    return
  if not _whole_tier(config) or exitstatus == pytest.ExitCode.INTERRUPTED:
    return
  reached = _reached().union(*_REACH["workers"])
  missed = sorted(package_modules() - reached)
  if missed:
    line = (f"{len(missed)} module(s) of sexpgpu/ reached by no test that ran: "
            + ", ".join(missed) + " (give each a test that is not marked slow, or import it "
            "inside the tests that use it)")
    _REACH["missed"] = line
    if config.pluginmanager.get_plugin("terminalreporter") is None:
      sys.stderr.write(line + "\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
  """The modules no test reached, in their own section above the counts."""
  if _REACH.get("missed"):
    terminalreporter.write_sep("=", "modules no test reached", red=True, bold=True)
    terminalreporter.write_line(_REACH["missed"], red=True)


def sexpgpu_cmd(*args):
  """The command line that runs the installed CLI with this interpreter."""
  return [sys.executable, "-m", "sexpgpu.cli.main", *args]


@pytest.fixture(scope="session")
def moto_endpoint():
  """One moto S3 server on 127.0.0.1 for the whole session; yields its endpoint URL."""
  from s3server import moto_server
  with moto_server() as endpoint:
    yield endpoint


@pytest.fixture
def s3_bucket(moto_endpoint, monkeypatch, request):
  """A fresh bucket on the session's moto server, named after the test, with this test's
  environment pointing at the server as a run reads it (credentials, endpoint).

  Yields:
    (its name, an s3fs filesystem on the server).
  """
  from s3server import bucket_fs
  monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
  monkeypatch.delenv("AWS_PROFILE", raising=False)
  name = "t-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())
  name = name[:60].strip("-")
  yield name, bucket_fs(moto_endpoint, name, monkeypatch)
