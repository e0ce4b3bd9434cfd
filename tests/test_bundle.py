"""`sexpgpu bundle`: an archive that runs the same selection elsewhere; refused when unsafe."""

import json
import os
import shutil
import subprocess
import zipfile

import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_file
from sexpgpu.tools.bundle import open_bundle, read_manifest

SEL = ["--variant", "smoke", "--set", "lr=0.01", "--set", "steps=10"]


def _summary(out: str) -> dict:
  s = json.loads(out.strip().splitlines()[-1])
  return {k: s[k] for k in ("steps", "train_loss", "eval", "counters", "slug")}


@pytest.fixture(scope="module")
def char_bundle(tmp_path_factory):
  """char-lm (a bytes loader) bundled with its data, and the original run's summary."""
  made = tmp_path_factory.mktemp("made")
  r = subprocess.run(sexpgpu_cmd("bundle", "configs/char-lm.sx", *SEL, "--with-data", "-o",
                                 str(made / "run.sxb")),
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  orig = subprocess.run(sexpgpu_cmd("run", "configs/char-lm.sx", *SEL, "--json"), cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert orig.returncode == 0, orig.stderr
  return made / "run.sxb", _summary(orig.stdout)


@pytest.mark.slow  # reads the char bundle: packs configs/shakespeare-char.sx with its data
def test_manifest(char_bundle):
  path, _ = char_bundle
  m = read_manifest(str(path))
  assert m["experiment"] == "char-lm.sx"
  assert m["variant"] == "smoke" and m["sets"] == [["lr", "0.01"], ["steps", "10"]]
  assert m["slug"] == "char-lm-smoke-lr=0.01-steps=10" and len(m["fingerprint"]) >= 16
  assert set(m["versions"]) >= {"sexpgpu", "jax"}
  assert m["files"]["data/corpus.txt"]["kind"] == "data"
  assert set(m["std"]) == {"std/nn.sx", "std/lm.sx"}
  with zipfile.ZipFile(path) as z:
    names = set(z.namelist())
  assert names == {"manifest.json", "char-lm.sx", "data/corpus.txt"}


@pytest.fixture(scope="module")
def user_run(char_bundle, tmp_path_factory):
  """`sexpgpu run copy.sxb` as a user runs it, from a folder without the original files,
  with checkpoints: (that folder, the finished process, its checkpoint folder)."""
  path, _ = char_bundle
  elsewhere = tmp_path_factory.mktemp("elsewhere")
  shutil.copy(path, elsewhere / "copy.sxb")
  ck = elsewhere / "ck"
  r = subprocess.run(sexpgpu_cmd("run", "copy.sxb", "--checkpoint-dir", str(ck), "--json"),
                     cwd=elsewhere, capture_output=True, text=True, timeout=120)
  return elsewhere, r, ck


@pytest.mark.slow  # a bundle's run and its checkpoint commands in subprocesses
def test_bundle_runs_elsewhere_with_the_same_summary(char_bundle, user_run):
  path, original = char_bundle
  elsewhere, user, _ = user_run
  cwd = os.getcwd()
  os.chdir(elsewhere)
  try:
    sx, variant, sets = open_bundle("copy.sxb")
  finally:
    os.chdir(cwd)
  assert os.path.basename(sx) == "char-lm.sx" and not sx.startswith(ROOT)
  argv = ["run", sx] + (["--variant", variant] if variant else [])
  for k, v in sets:
    argv += ["--set", f"{k}={v}"]
  r = subprocess.run(sexpgpu_cmd(*argv, "--json"), cwd=elsewhere, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  assert _summary(r.stdout) == original
  assert open_bundle(str(elsewhere / "copy.sxb"))[0] == sx  # extracted once, reused
  # as a user runs it: `sexpgpu run copy.sxb` from a folder without the original files
  assert user.returncode == 0, user.stderr
  assert user.stderr.startswith("run: copy.sxb slug ")
  assert _summary(user.stdout) == original


def _rewrite(src, dst, change):
  with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
    for info in zin.infolist():
      name, data = change(info.filename, zin.read(info))
      if name is not None:
        zout.writestr(name, data)


@pytest.mark.slow  # reads the char bundle: packs configs/shakespeare-char.sx with its data
def test_tampered_member_is_e_bundle_002(char_bundle, tmp_path):
  path, _ = char_bundle
  bad = tmp_path / "bad.sxb"
  _rewrite(path, bad, lambda n, d: (n, d.replace(b"lr 3e-3", b"lr 3e-2") if n == "char-lm.sx"
                                    else d))
  with pytest.raises(SxError) as e:
    open_bundle(str(bad))
  assert e.value.code == "E-BUNDLE-002" and "char-lm.sx" in e.value.message
  unlisted = tmp_path / "unlisted.sxb"
  _rewrite(path, unlisted, lambda n, d: (n, d))
  with zipfile.ZipFile(unlisted, "a") as z:
    z.writestr("extra.sx", "(defknob x 1)")
  with pytest.raises(SxError) as e:
    open_bundle(str(unlisted))
  assert e.value.code == "E-BUNDLE-002" and "extra.sx" in e.value.message


@pytest.mark.slow  # reads the char bundle: packs configs/shakespeare-char.sx with its data
@pytest.mark.parametrize("member", ["../x.sx", "/tmp/sexpgpu-abs-member.sx", "a/../../x.sx"])
def test_unsafe_member_is_e_bundle_001(char_bundle, tmp_path, member):
  path, _ = char_bundle
  bad = tmp_path / "bad.sxb"
  _rewrite(path, bad, lambda n, d: (n, d))
  with zipfile.ZipFile(bad, "a") as z:
    z.writestr(zipfile.ZipInfo(member), "(defknob x 1)")
  with pytest.raises(SxError) as e:
    open_bundle(str(bad))
  assert e.value.code == "E-BUNDLE-001" and member in e.value.message
  assert not (tmp_path / "x.sx").exists() and not os.path.exists("/tmp/sexpgpu-abs-member.sx")


def test_without_data_records_what_is_left_out(tmp_path):
  r = subprocess.run(sexpgpu_cmd("bundle", "configs/classifier.sx", "--variant", "smoke", "-o",
                                 str(tmp_path / "c.sxb")),
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "data/blobs.npz not bundled (add --with-data)" in r.stderr
  m = read_manifest(str(tmp_path / "c.sxb"))
  assert m["data_not_bundled"] == ["data/blobs.npz"] and list(m["files"]) == ["classifier.sx"]


@pytest.mark.slow  # reads the char bundle: packs configs/shakespeare-char.sx with its data
def test_a_tar_of_the_same_members_is_refused_as_a_tar(char_bundle, tmp_path):
  """A bundle is the zip `sexpgpu bundle` writes: tarfile reads a pax or long-name header
  whole, whatever size it declares, so a tar is not opened (its links included)."""
  import io
  import tarfile
  path, _ = char_bundle
  with zipfile.ZipFile(path) as z:
    members = {n: z.read(n) for n in z.namelist()}
  with tarfile.open(tmp_path / "t.sxb", "w") as t:
    for n, data in members.items():
      info = tarfile.TarInfo(n)
      info.size = len(data)
      t.addfile(info, io.BytesIO(data))
  with pytest.raises(SxError) as e:
    open_bundle(str(tmp_path / "t.sxb"))
  assert e.value.code == "E-BUNDLE-002" and "a tar archive; a bundle is the zip" in e.value.message


def test_check_of_a_bundle_without_its_data_says_where_to_put_it(tmp_path, monkeypatch, capsys):
  from sexpgpu.cli.main import main
  from sexpgpu.tools.bundle import make_bundle
  make_bundle(os.path.join(ROOT, "configs", "classifier.sx"), str(tmp_path / "c.sxb"), "smoke")
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cache"))
  capsys.readouterr()
  assert main(["check", str(tmp_path / "c.sxb")]) == 1
  err = capsys.readouterr().err
  assert err.startswith("error[E-LOAD-001]") and (
      f"fix: this bundle was made without --with-data: put data/blobs.npz beside c.sxb (in "
      f"{tmp_path})") in err


@pytest.mark.slow  # a bundle's run and its checkpoint commands in subprocesses
def test_the_checkpoint_commands_take_a_bundle_as_run_does(char_bundle, user_run, tmp_path):
  """`export` (as sample, eval and import, through one compile) opens a bundle and compiles
  its own selection: the slug the run of a copy of it wrote under is the one it finds."""
  path, original = char_bundle
  _, user, ckpt = user_run
  assert user.returncode == 0, user.stderr
  out = tmp_path / "w.safetensors"
  r = subprocess.run(sexpgpu_cmd("export", str(path), "--resume", "latest", "--checkpoint-dir",
                                 str(ckpt), "-o", str(out)),
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert out.stat().st_size > 0
  r = subprocess.run(sexpgpu_cmd("export", str(path), "--variant", "big", "--resume", "latest",
                                 "--checkpoint-dir", str(ckpt), "-o", str(out)),
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 1 and "error[E-VARIANT-001]" in r.stderr, r.stderr


@pytest.mark.slow  # reads the char bundle: packs configs/shakespeare-char.sx with its data
def test_a_bundle_made_with_another_std_says_which_file_differs(char_bundle, tmp_path,
                                                                 monkeypatch, capsys):
  """The manifest's std hashes are compared with this installation's files: each that differs
  (or is gone) is one line on standard error, and the run goes on with the installed one; a
  name that is no std file (hostile) is not looked up."""
  path, _ = char_bundle
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cache"))
  open_bundle(str(path))
  assert capsys.readouterr().err == ""  # made with this installation's std: nothing to say

  def change(name, data):
    if name != "manifest.json":
      return name, data
    m = json.loads(data)
    m["std"].update({"std/lm.sx": "0" * 64, "std/gone.sx": "1" * 64, "std/../x.sx": "2" * 64})
    m["versions"]["sexpgpu"] = "0.0.9"
    return name, json.dumps(m).encode()
  other = tmp_path / "other.sxb"
  _rewrite(path, other, change)
  sx, _, _ = open_bundle(str(other))
  assert os.path.isfile(sx)
  assert capsys.readouterr().err.splitlines() == [
      "bundle: std/gone.sx of sexpgpu 0.0.9 is not in this installation",
      "bundle: std/lm.sx differs from the one the bundle was made with (sexpgpu 0.0.9); this "
      "run compiles this installation's, so its results may differ from the bundle's"]


@pytest.mark.slow  # reads the char bundle: packs configs/shakespeare-char.sx with its data
def test_an_extraction_killed_outright_is_swept_by_the_next(char_bundle, tmp_path, monkeypatch):
  """A `.tmp` folder of a process that no longer exists (SIGKILL mid-extraction) is removed
  when the bundle is next opened; one of a living process is left to it."""
  from sexpgpu.tools.bundle import sha256_file
  path, _ = char_bundle
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cache"))
  dest = tmp_path / "cache" / "bundles" / sha256_file(str(path))[:32]
  dead = subprocess.Popen(["true"])
  dead.wait()
  abandoned, living = (dest.parent / f"{dest.name}.{dead.pid}.tmp",
                       dest.parent / f"{dest.name}.{os.getppid()}.tmp")
  for d in (abandoned, living):
    (d / "half").mkdir(parents=True)
  open_bundle(str(path))
  assert dest.is_dir() and not abandoned.exists() and living.exists()


@pytest.mark.slow  # reads the char bundle: packs configs/shakespeare-char.sx with its data
def test_check_of_a_bundle_names_the_bundle_not_its_extracted_copy(char_bundle, tmp_path,
                                                                    monkeypatch, capsys):
  from sexpgpu.cli.main import main
  path, original = char_bundle
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cache"))
  capsys.readouterr()
  assert main(["check", str(path)]) == 0
  first = capsys.readouterr().out.splitlines()[0]
  assert first.startswith(f"check: {path} slug {original['slug']} fingerprint "), first


# -- bundles with a text loader --------------------------------------------------------------

TEXT_EXP = """
(require std/nn)
(require std/lm)
(defloader train (text "cache" :seq 9 :batch 2 :pack docs))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (transformer-lm (lm-inputs t) :vocab 300 :width 16 :layers 1 :heads 2) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :seed 3)
"""


@pytest.fixture(scope="module")
def text_exp(tmp_path_factory):
  from sexpgpu.tools.tokenize import Options, tokenize
  folder = tmp_path_factory.mktemp("textbundle")
  corpus = open(os.path.join(ROOT, "tests", "data", "corpus.txt"), encoding="utf-8").read()
  paras = [p for p in corpus.split("\n\n") if p.strip()] * 3
  (folder / "docs.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in paras) + "\n")
  tokenize(Options((str(folder / "docs.jsonl"),), str(folder / "cache"), train_bpe=300),
           progress=False)
  (folder / "text.sx").write_text(TEXT_EXP)
  return folder


def test_a_bundle_with_data_carries_a_text_loaders_cache(text_exp, tmp_path, monkeypatch):
  from sexpgpu.tools.bundle import make_bundle, open_bundle, read_manifest
  out = str(tmp_path / "t.sxb")
  make_bundle(str(text_exp / "text.sx"), out, with_data=True)
  files = read_manifest(out)["files"]
  cache = sorted(os.path.relpath(os.path.join(r, n), text_exp).replace(os.sep, "/")
                 for r, _, ns in os.walk(text_exp / "cache") for n in ns)
  assert "cache/manifest.json" in cache and "cache/tokenizer.json" in cache
  assert sorted(f for f in files if f.startswith("cache/")) == cache
  assert all(files[f]["kind"] == "data" for f in cache)
  assert read_manifest(out)["data_not_bundled"] == []
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cachedir"))
  exp, _, _ = open_bundle(out)
  assert compile_file(exp).loaders["train"].records > 0  # the cache read from the bundle


def test_a_bundle_without_data_names_the_cache_it_left_out(text_exp, tmp_path, capsys):
  out = str(tmp_path / "t.sxb")
  assert main(["bundle", str(text_exp / "text.sx"), "-o", out]) == 0
  assert "loader train: cache not bundled (add --with-data)" in capsys.readouterr().err
