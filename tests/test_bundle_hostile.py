"""Hostile bundles (issue 37: 2, 4, 8, 14): each is refused with its E-code before a byte
leaves the archive, or stopped while it is written, and nothing is left in the cache."""

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import zipfile

import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.tools import bundle_manifest as bm
from sexpgpu.tools.bundle import extract, make_bundle, open_bundle, read_manifest

_spec = importlib.util.spec_from_file_location("fuzz_bundles", os.path.join(
    ROOT, "benchmarks", "fuzz_bundles.py"))
fb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fb)

# The code each named hostile archive is refused with (those named manifest-* not listed
# here: E-BUNDLE-003, a field of the wrong type or value).
EXPECTED = {
    **{n: "E-BUNDLE-001" for n in (
        "experiment-parent", "experiment-absolute", "experiment-dotdot-mid", "member-parent",
        "member-absolute", "member-dotdot-mid", "member-zip-symlink", "manifest-files-key-dot",
        "manifest-files-key-backslash")},
    **{n: "E-BUNDLE-002" for n in (
        "tar-symlink", "tar-hardlink", "tar-chardev", "tar-fifo", "tar-gzip", "zip-bomb-real",
        "manifest-missing", "member-unlisted", "member-missing", "member-duplicate",
        "member-encrypted", "member-bzip2", "member-method-99", "truncated", "truncated-end",
        "corrupt", "not-a-zip", "empty", "binary", "a-folder", "a-fifo", "dev-zero")},
    **{n: "E-BUNDLE-004" for n in (
        "zip-bomb-declared", "member-count-bomb", "manifest-deep", "manifest-deep-object",
        "manifest-huge", "member-tampered", "member-padded", "directory-count-bomb",
        "directory-size-bomb", "prepended")},
    "dangling-link": "E-REQ-001",
    # 2 GiB declared by both: refused for want of room, or cut short while written
    "zip-bomb-agreeing": ("E-BUNDLE-002", "E-BUNDLE-005"),
}


@pytest.fixture(scope="module")
def named(tmp_path_factory):
  """The named hostile archives and the real bundle they were made from."""
  folder = tmp_path_factory.mktemp("hostile")
  return fb.hostile_bundles(str(folder)), fb.base_bundle(str(folder))


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """A cache folder of this test's own, to see what extraction leaves in it."""
  folder = tmp_path / "cache"
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(folder))
  return folder


def _cli(*argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(list(argv))
  return code, out.getvalue(), err.getvalue()


def _left(cache) -> list[str]:
  folder = cache / "bundles"
  return sorted(os.listdir(folder)) if folder.is_dir() else []


def test_every_named_hostile_bundle_is_refused_by_run_and_check(named, cache):
  cases, _ = named
  assert len(cases) >= 120
  seen = set()
  for name, path in cases:
    want = EXPECTED.get(name, "E-BUNDLE-003" if name.startswith("manifest-") else None)
    assert want is not None, name
    for argv in (["check", path], ["run", path, "--steps", "1"]):
      code, out, err = _cli(*argv)
      got = re.match(r"error\[(E-[A-Z]+-\d+)\]", err)
      assert code == 1 and got and got.group(1) in want, (name, argv[0], err)
      assert "Traceback" not in err and "done:" not in err, (name, err)
      assert _left(cache) == [], (name, _left(cache))  # nothing extracted, no .tmp left
    seen.add(got.group(1))
  assert seen >= {"E-BUNDLE-001", "E-BUNDLE-002", "E-BUNDLE-003", "E-BUNDLE-004", "E-REQ-001"}


def test_a_manifest_experiment_outside_the_archive_is_not_run(named, cache):
  """Finding 2: `"experiment": "../../elsewhere/outside.sx"` ran the file it pointed at."""
  cases, _ = named
  outside = cache / "elsewhere" / "outside.sx"  # where the join would land from bundles/<digest>
  outside.parent.mkdir(parents=True)
  shutil.copy(os.path.join(ROOT, "configs", "tiny-lm.sx"), outside)
  path = dict(cases)["experiment-parent"]
  code, _, err = _cli("run", path, "--steps", "1")
  assert code == 1 and "error[E-BUNDLE-001]" in err and "../../elsewhere/outside.sx" in err
  assert "`experiment`" in err and "run:" not in err


@pytest.mark.parametrize("field,value,named_as", [
    ("sets", "lr=0.01", "`sets` is the string"), ("sets", [["lr"], "x"], "`sets[0]` is a list"),
    ("sets", [[["lr"], "0.01"]], "`sets[0][0]` is a list"), ("variant", ["smoke"], "`variant`"),
    ("experiment", None, "`experiment` is null"), ("files", [], "`files` is a list"),
    ("format", "zip", "`format`"), ("version", "1", "`version` is the string")])
def test_a_manifest_field_of_the_wrong_type_is_named(named, cache, tmp_path, field, value,
                                                     named_as):
  """Finding 8: these were four tracebacks; now one validator names the field."""
  _, base = named
  manifest, members = fb._parts(base)
  manifest[field] = value
  path = fb._zip(str(tmp_path / "bad.sxb"), manifest, members)
  code, _, err = _cli("run", path, "--steps", "1")
  assert code == 1 and err.startswith("error[E-BUNDLE-003]") and named_as in err, err
  assert "it must be" in err and "Traceback" not in err
  with pytest.raises(SxError) as e:
    bm.validate(json.loads(json.dumps(manifest)), "x.sxb")
  assert e.value.code == "E-BUNDLE-003" and e.value.where.startswith("x.sxb: manifest.json `")


def test_the_validator_returns_a_typed_record(named):
  _, base = named
  m = bm.validate(fb._parts(base)[0], "base.sxb")
  assert m.experiment == "char-lm.sx" and m.variant == "smoke" and m.sets == (("steps", "2"),)
  assert set(m.files) == {"char-lm.sx", "data/corpus.txt"}
  assert m.files["data/corpus.txt"].kind == "data" and m.total_bytes() == sum(
      f.size for f in m.files.values())


def test_a_member_larger_than_its_manifest_writes_nothing(named, cache):
  """Finding 4: the archive's 8 MiB member was written out before the sizes were checked."""
  cases, _ = named
  code, _, err = _cli("run", dict(cases)["zip-bomb-declared"], "--steps", "1")
  assert code == 1 and "error[E-BUNDLE-004]" in err and "declares 8388608 bytes" in err
  assert _left(cache) == []


def test_a_member_past_its_size_stops_where_the_manifest_says(named, tmp_path, cache):
  """A stream that holds more than its member's byte count is cut at count + 1 bytes."""
  _, base = named
  archive = bm.Archive(bm.open_regular(base), base)
  try:
    manifest = archive.read_manifest()
    small = dict(manifest.files)
    small["data/corpus.txt"] = bm.Member("data/corpus.txt", "0" * 64, 100, "data")
    with pytest.raises(SxError) as e:
      extract(archive, bm.Manifest(manifest.experiment, None, (), small, (), (), {}),
                 str(tmp_path / "out.tmp"))
  finally:
    archive.close()
  assert e.value.code == "E-BUNDLE-004" and "more than the 100 bytes" in e.value.message
  assert not (tmp_path / "out.tmp").exists()


def _in_small_tmpfs(tmp_path, options: str, *argv) -> tuple[str, list[str]] | None:
  """Runs `sexpgpu ARGV` with SEXPGPU_CACHE_DIR on a tmpfs mounted with `options`; returns
  (standard error, what the cache folder held after), or None without mount namespaces."""
  disk = tmp_path / "disk"
  disk.mkdir(exist_ok=True)
  probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {disk}"],
                         capture_output=True, timeout=30, check=False) if shutil.which(
                             "unshare") else None
  if probe is None or probe.returncode != 0:
    return None
  cmd = " ".join(f"'{a}'" for a in sexpgpu_cmd(*argv))
  script = (f"mount -t tmpfs -o {options} tmpfs {disk} && {{ SEXPGPU_CACHE_DIR={disk} {cmd}; "
            f"echo $? > {tmp_path / 'rc'}; "
            f"find {disk} -mindepth 1 | sort > {tmp_path / 'left'}; }}")
  r = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True,
                     text=True, timeout=120, check=False)
  assert (tmp_path / "rc").read_text().strip() == "1", r.stderr
  left = (tmp_path / "left").read_text().split()
  return r.stderr, [os.path.relpath(p, disk) for p in left]


@pytest.mark.slow  # a bundle extracted in a subprocess
def test_a_full_disk_mid_extraction_is_e_bundle_005_and_leaves_nothing(named, tmp_path):
  """Finding 4: ENOSPC while writing was an OSError traceback and a `.tmp` folder left.
  Five inodes: the folder, bundles/, the temporary folder, char-lm.sx and data/ fit;
  data/corpus.txt does not."""
  _, base = named
  got = _in_small_tmpfs(tmp_path, "size=1m,nr_inodes=5", "check", base)
  if got is None:
    pytest.skip("no mount namespace for a small tmpfs (needs root and unshare)")
  err, left = got
  disk = tmp_path / "disk"
  assert err.startswith(f"error[E-BUNDLE-005]: the bundle cannot be extracted into "
                        f"{disk}/bundles: No space left on device"), err
  assert f"--> {disk}/bundles" in err and "SEXPGPU_CACHE_DIR" in err and "Traceback" not in err
  assert left == ["bundles"]  # the temporary folder went with the failure


@pytest.mark.slow  # a bundle extracted in a subprocess
def test_a_disk_without_room_for_the_manifests_bytes_is_refused_before_writing(named, tmp_path):
  _, base = named
  got = _in_small_tmpfs(tmp_path, "size=16k", "run", base, "--steps", "1")
  if got is None:
    pytest.skip("no mount namespace for a small tmpfs (needs root and unshare)")
  err, left = got
  need = sum(f["bytes"] for f in read_manifest(base)["files"].values())
  assert err.startswith(f"error[E-BUNDLE-005]: the bundle needs {need} bytes in "), err
  assert left == ["bundles"]


@pytest.mark.slow  # a process timed against a fifo
def test_a_fifo_named_sxb_does_not_hang(tmp_path):
  fifo = tmp_path / "x.sxb"
  os.mkfifo(fifo)
  r = subprocess.run(sexpgpu_cmd("check", str(fifo)), cwd=ROOT, capture_output=True, text=True,
                     timeout=60, check=False)
  assert r.returncode == 1 and r.stderr.startswith("error[E-BUNDLE-002]") and "a FIFO" in r.stderr


def test_check_takes_a_bundle_as_run_does(named, cache):
  """Finding 14: `check run.sxb` answered E-READ-003 (not UTF-8)."""
  _, base = named
  code, out, err = _cli("check", base)
  assert code == 0, err
  assert "slug char-lm-smoke-steps=2 " in out and "knobs:" in out  # the bundle's selection
  code, _, err = _cli("check", base, "--variant", "nope")
  assert code == 1 and err.startswith("error[E-VARIANT-001]: the bundle was made with "
                                      "--variant smoke; --variant nope cannot replace it")
  code, out, _ = _cli("check", base, "--set", "steps=7", "--print", "knobs")
  assert code == 0 and re.search(r"^steps +7 +set$", out, re.M), out  # a --set here wins


def test_commands_that_take_an_experiment_refuse_a_bundle_by_name(named, tmp_path):
  _, base = named
  code, _, err = _cli("sweep", base, "--set", "lr=1e-3,3e-3")
  assert code == 1 and err.startswith("error[E-FORM-001]: sexpgpu sweep takes an experiment "
                                      f"file (.sx); `{base}` is a bundle"), err
  code, _, err = _cli("bundle", base, "-o", str(tmp_path / "again.sxb"))
  assert code == 1 and "sexpgpu bundle takes an experiment file" in err
  assert not (tmp_path / "again.sxb").exists()


def test_make_bundle_refuses_what_open_bundle_would(named, tmp_path, monkeypatch):
  monkeypatch.setattr(bm, "MAX_MEMBERS", 1)
  with pytest.raises(SxError) as e:
    make_bundle(os.path.join(ROOT, "configs", "char-lm.sx"), str(tmp_path / "b.sxb"),
                "smoke", with_data=True)
  assert e.value.code == "E-BUNDLE-004" and "2 files" in e.value.message
  assert not (tmp_path / "b.sxb").exists()


def test_a_changed_extraction_is_extracted_again(named, cache):
  _, base = named
  exp, _, _ = open_bundle(base)
  with open(exp, "a", encoding="utf-8") as f:
    f.write("(defknob planted 1)\n")
  assert open_bundle(base)[0] == exp
  assert "planted" not in open(exp, encoding="utf-8").read()
  assert [n for n in _left(cache) if n.endswith(".tmp")] == []


def test_the_fuzz_oracle_catches_an_exit_0_for_a_bad_bundle(named):
  """feed() reports a bundle known to be bad that a command accepted (a test of the test)."""
  _, base = named
  assert fb.feed(["check", base], known_bad=True) == "exit 0 for a bundle known to be bad"
  assert fb.feed(["check", base], known_bad=False) is None


@pytest.mark.slow
def test_fuzz_slice(tmp_path, cache):
  """60 cases: named hostile archives and randomized mutations of a real bundle, through
  check and run (`python benchmarks/fuzz_bundles.py --count 500` runs more)."""
  refused = fb.FED.get(("check", 1), 0)
  fed, findings = fb.fuzz(60, seed=3, folder=str(tmp_path))
  assert fed == 60 and not findings, "\n".join(findings)
  assert fb.FED.get(("check", 1), 0) - refused >= 40  # (53 at seed 3: 20 named, 33 mutated)


def test_mutations_cover_the_kinds(named, tmp_path):
  import random
  _, base = named
  kinds = [fb.mutated(random.Random(i), base, str(tmp_path), i) for i in range(60)]
  whats = " ".join(w for w, _, _ in kinds)
  assert all(k in whats for k in ("rename", "bytes of", "an extra member", "the archive's"))
  assert any(bad for _, _, bad in kinds) and not all(bad for _, _, bad in kinds)
  with zipfile.ZipFile(base) as z:
    assert z.namelist()[0] == "manifest.json"
