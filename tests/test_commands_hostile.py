"""Issue 37, findings 11-13: `sample`, `eval`, `plot` and `watch` given hostile files and flag
values end in an error code naming the flag or file, within their bounds, before anything is
compiled; and a slice of benchmarks/fuzz_commands.py (`--count 1000` runs more)."""

import importlib.util
import json
import os
import threading

import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError

_spec = importlib.util.spec_from_file_location("fuzz_commands", os.path.join(
    ROOT, "benchmarks", "fuzz_commands.py"))
fc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fc)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A tiny GPT-2 (24 tokens, a window of 8), its step-0 checkpoint and a tokenizer."""
  return fc.checkpoint(str(tmp_path_factory.mktemp("hostile-model")))


def _ends(argv, capsys, code="E-FORM-001", where=None, timeout=30.0) -> str:
  """Runs `sexpgpu ARGV` in a thread (a hang fails the test, not the suite); asserts exit 1
  with `code` (and the `--> where` line) and no traceback; returns standard error."""
  got = []
  t = threading.Thread(target=lambda: got.append(main(argv)), daemon=True)
  t.start()
  t.join(timeout)
  assert got, f"sexpgpu {' '.join(argv)[:200]} did not end within {timeout} s"
  err = capsys.readouterr().err
  assert got == [1] and f"error[{code}]" in err and "Traceback" not in err, err
  if where is not None:
    assert f"  --> {where}\n" in err, err
  return err


# --- 11: sample ----------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value, says", [
    ("--tokens", "1000000000000", "--tokens is 1000000000000; it takes 1 to 65536"),
    ("--tokens", "0", "it takes 1 to 65536"),
    ("--temperature", "-1", "--temperature is -1; it takes 0, or 0.0001 to 100"),
    ("--temperature", "1e-9", "it takes 0, or 0.0001 to 100"),
    ("--temperature", "1e300", "it takes 0, or 0.0001 to 100"),
    ("--top-k", "-3", "--top-k is -3; it takes 0 to 2147483647"),
    ("--top-k", "2147483648", "it takes 0 to 2147483647"),
    ("--top-p", "0", "--top-p is 0; it takes more than 0, at most 1"),
    ("--top-p", "1.5", "more than 0, at most 1"),
    ("--seed", "-1", "--seed is -1; it takes 0 to 4294967295"),
    ("--seed", "4294967296", "it takes 0 to 4294967295"),  # would draw as seed 0 does
])
def test_sample_flags_out_of_range_are_refused_before_the_compile(ckpt, capsys, flag, value,
                                                                   says):
  err = _ends(["sample", ckpt.sx, "--resume", ckpt.step, "--prompt", "1 2", flag, value],
              capsys, where=flag)
  assert says in err and "= fix: give " + flag in err
  # checked first: the refusal is the same with no experiment at all
  _ends(["sample", "/nonexistent.sx", "--resume", "x", "--prompt", "1", flag, value], capsys,
        where=flag)


@pytest.mark.parametrize("what, says", [
    ("binary", "is not UTF-8 text (byte 0 is 0xff)"),
    ("dev-zero", "/dev/zero: is a character device, not a regular file"),
    ("fifo", "is a FIFO (named pipe), not a regular file"),
    ("folder", "is a folder, not a regular file"),
    ("link-to-dev-zero", "is a character device"),
])
def test_a_prompt_file_that_is_no_small_text_file(ckpt, tmp_path, capsys, what, says):
  path = fc.hostile_files(str(tmp_path))[what]
  err = _ends(["sample", ckpt.sx, "--resume", ckpt.step, "--prompt-file", path], capsys,
              where="--prompt-file")
  assert says in err and "at most 1 MiB" in err


def test_a_prompt_file_past_1_mib_and_a_tokenizer_that_is_dev_zero(ckpt, tmp_path, capsys):
  big = tmp_path / "big.txt"
  big.write_text("1 " * (1 << 19) + "1")  # 1 MiB + 1 byte
  err = _ends(["sample", ckpt.sx, "--resume", ckpt.step, "--prompt-file", str(big)], capsys)
  assert "is larger than 1 MiB" in err
  err = _ends(["sample", ckpt.sx, "--resume", ckpt.step, "--prompt", "1", "--tokenizer",
               "/dev/zero"], capsys, code="E-TOK-002", where="--tokenizer")
  assert "character device" in err


def test_a_prompt_file_samples_as_the_same_prompt_given_inline(ckpt, tmp_path, capsys):
  path = tmp_path / "p.txt"
  path.write_text("3 1 4\n")
  outs = []
  for source in (["--prompt-file", str(path)], ["--prompt", "3 1 4"]):
    assert main(["sample", ckpt.sx, "--resume", ckpt.step, *source, "--tokens", "4",
                 "--json", "--seed", "4294967295"]) == 0
    outs.append(json.loads(capsys.readouterr().out))
  assert outs[0]["prompt_ids"] == [3, 1, 4] and outs[0]["ids"] == outs[1]["ids"]
  assert len(outs[0]["ids"]) == 4


def test_a_prompt_word_of_other_digits_or_5000_digits_is_no_token_id():
  from sexpgpu.models.sample import parse_ids
  for word in ("\u00b2", "9" * 5000):  # "²".isdigit(), and int() past 4,300 digits
    with pytest.raises(SxError) as e:
      parse_ids(f"1 {word}")
    assert e.value.code == "E-FORM-001" and "is not a token id" in e.value.message


def test_a_top_p_that_f32_rounds_to_0_keeps_the_likeliest_token():
  import jax
  import jax.numpy as jnp
  from sexpgpu.models.sample import Settings, choose
  logits = jnp.asarray([0.0, 3.0, 1.0, 2.9], jnp.float32)
  got = {int(choose(logits, jax.random.key(i), Settings(temperature=1.0, top_p=1e-300)))
         for i in range(8)}
  assert got == {1}  # not token 0, the least likely, as when every token was dropped


# --- 12: eval ------------------------------------------------------------------------------

def _task(tmp_path, *lines) -> str:
  path = tmp_path / "t.jsonl"
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


GOOD = '{"context": "the sky is", "choices": ["blue", "green"], "gold": 0}'


@pytest.mark.parametrize("line, says", [
    ("[" * 100_000 + "]" * 100_000, "JSON nested deeper than 64 levels"),
    ('{"text": ' + "[" * 900 + "]" * 900 + "}", "JSON nested deeper than 64 levels"),
    ('{"context": "a", "choices": "ab", "gold": 0}', '"choices" must be a list of two or more'),
    ('{"context": "a", "choices": ["b", 3], "gold": 0}', '"choices" must be a list'),
    ('{"context": "a", "choices": ["b", "c"], "gold": 1.0}', '"gold" must be the index of a '
     'choice, 0..1; found 1.0'),
    ('{"context": "a", "choices": ["b", "c"], "gold": true}', '"gold" must be the index'),
    ('{"context": "a", "choices": ["b", "c"], "gold": "0"}', '"gold" must be the index'),
    ('{"context": "a", "choices": ["b", "c"], "gold": 1e400}', "found Infinity"),
    ('{"context": 5, "choices": ["b", "c"], "gold": 0}', '"context" must be a string'),
    ('{"text": 5}', '"text" must be a non-empty string'),
    ('{"text": null}', '"text" must be a non-empty string'),
    ('{"gold": ' + "9" * 5000 + "}", "not JSON (Exceeds the limit"),
])
def test_a_task_line_nested_deep_or_of_wrong_types_names_its_file_line_and_field(
    tmp_path, line, says):
  from sexpgpu.models.evaluate import load_task
  path = _task(tmp_path, GOOD, line)
  with pytest.raises(SxError) as e:
    load_task(path)
  assert e.value.code == "E-EVAL-001" and e.value.message.startswith(f"{path}:2: ")
  assert says in e.value.message and e.value.location.line == 2


@pytest.mark.parametrize("what, says", [
    ("binary", "is not UTF-8 text"), ("dev-zero", "is a character device"),
    ("fifo", "is a FIFO"), ("huge-line", "line 1 is longer than 16 MiB"),
    ("empty", "holds no document"),
])
def test_a_task_file_that_is_no_jsonl_file(ckpt, tmp_path, capsys, what, says):
  path = fc.hostile_files(str(tmp_path))[what]
  err = _ends(["eval", ckpt.sx, "--resume", ckpt.step, "--tokenizer", ckpt.tokenizer,
               "--tasks", path], capsys, code="E-EVAL-001", where=path)
  assert says in err


def test_a_task_file_is_read_to_its_limit_only(tmp_path):
  from sexpgpu.models.evaluate import load_task
  task = load_task(_task(tmp_path, GOOD, GOOD, "[" * 100_000), limit=2)
  assert len(task.docs) == 2  # the third line, past --limit, is not read


@pytest.mark.parametrize("flag, value, says", [
    ("--batch", "1000000000", "--batch is 1000000000; it takes 1 to 4096"),
    ("--batch", "0", "--batch is 0"), ("--limit", "0", "--limit is 0"),
])
def test_eval_flags_out_of_range_are_refused_before_the_compile(ckpt, tmp_path, capsys, flag,
                                                                 value, says):
  argv = ["eval", ckpt.sx, "--resume", ckpt.step, "--tokenizer", ckpt.tokenizer, "--tasks",
          _task(tmp_path, GOOD), flag, value]
  assert says in _ends(argv, capsys, where=flag)
  argv[1] = "/nonexistent.sx"
  _ends(argv, capsys, where=flag)


def test_a_batch_past_the_memory_is_refused_before_the_call(ckpt, tmp_path, capsys,
                                                            monkeypatch):
  from sexpgpu.models.evaluate import call_bytes, check_memory
  monkeypatch.setenv("SEXPGPU_MEMORY", "1MiB")
  with pytest.raises(SxError) as e:
    check_memory(4096, 8, 24)
  fits = (1 << 20) // call_bytes(1, 8, 24)
  assert e.value.code == "E-MEM-001" and f"at most {fits} rows" in e.value.fix
  check_memory(fits, 8, 24)  # the batch it names fits
  err = _ends(["eval", ckpt.sx, "--resume", ckpt.step, "--tokenizer", ckpt.tokenizer, "--tasks",
               _task(tmp_path, GOOD), "--batch", "4096"], capsys, code="E-MEM-001")
  assert "a scoring call of 4096 rows of 8 positions and 24 logits needs" in err


def test_eval_scores_a_task_within_the_bounds(ckpt, tmp_path, capsys):
  path = _task(tmp_path, GOOD, "", '{"context": "a river", "choices": ["ran", "mill"], '
               '"gold": 1}')
  assert main(["eval", ckpt.sx, "--resume", ckpt.step, "--tokenizer", ckpt.tokenizer, "--tasks",
               path, "--batch", "3", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["tasks"][0]["documents"] == 2 and set(out["metrics"]) == {"eval/t/acc",
                                                                       "eval/t/acc_norm"}


# --- 13: plot and watch --------------------------------------------------------------------

def _metrics(tmp_path, *extra) -> str:
  path = tmp_path / "m.jsonl"
  lines = [json.dumps({"kind": "step", "slug": "a", "step": s, "train/loss": 3 - s / 10})
           for s in range(1, 5)]
  path.write_text("\n".join(lines + list(extra)) + "\n")
  return str(path)


def test_plot_skips_a_deep_line_and_lines_of_wrong_types_and_says_so(tmp_path, capsys):
  from sexpgpu.tools.plot import plot
  path = _metrics(tmp_path, "[" * 100_000 + "]" * 100_000, '{"kind": "step", "step": "x", '
                  '"train/loss": 1}', '{"kind": "step", "step": 1e400, "train/loss": 1}',
                  '{"kind": "pass", "step": 3, "metrics": [1]}', '{"kind": "stage", "step": '
                  '[1]}', '{"kind": "step", "step": 9, "train/loss": 1e400}', '{"kind": "st')
  skipped = {}
  fig = plot([path], ["train/loss"], str(tmp_path / "c.png"), skipped=skipped)
  (line,) = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == "curve"]
  assert list(line.get_xdata()) == [1, 2, 3, 4]  # the wrong-typed events left out
  assert skipped == {path: [5, 11]}  # the deep line and the torn last one
  assert main(["plot", path, "-o", str(tmp_path / "d.png")]) == 0
  assert f"plot: {path}: 2 lines skipped that are no JSON object (line 5, 11)" in (
      capsys.readouterr().err)


def test_plot_of_nothing_but_a_deep_line(tmp_path, capsys):
  path = tmp_path / "deep.jsonl"
  path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
  err = _ends(["plot", str(path), "-o", str(tmp_path / "c.png")], capsys, code="E-METRICS-001")
  assert "no values of train/loss, eval/loss" in err and "plot: " + str(path) + ": 1 line skipped that is no JSON object (line 1)" in err
  assert not os.path.exists(tmp_path / "c.png")


@pytest.mark.parametrize("what", ["dev-zero", "fifo", "folder", "binary", "huge-line"])
def test_plot_of_a_file_that_is_no_metrics_file(tmp_path, capsys, what):
  path = fc.hostile_files(str(tmp_path))[what]
  _ends(["plot", path, "-o", str(tmp_path / "c.png")], capsys, code="E-METRICS-001", where=path)


def test_plot_to_a_fifo_a_folder_or_nowhere_is_refused_and_keeps_what_was_there(tmp_path,
                                                                                capsys):
  path = _metrics(tmp_path)
  fifo = fc.hostile_files(str(tmp_path))["fifo"]
  for out in (fifo, str(tmp_path)):
    assert "is a folder, FIFO or device" in _ends(["plot", path, "-o", out], capsys,
                                                  code="E-METRICS-001", where="-o")
  _ends(["plot", path, "-o", "/proc/nope/c.png"], capsys, code="E-METRICS-001", where="-o")
  _ends(["plot", path, "--metric", ",".join(f"m{i}" for i in range(40))], capsys,
        code="E-METRICS-001", where="--metric")
  old = tmp_path / "keep.png"
  old.write_bytes(b"old")
  _ends(["plot", path, "--metric", "nope", "-o", str(old)], capsys, code="E-METRICS-001")
  assert old.read_bytes() == b"old"


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "holds an array, where an object was expected"),
    ('"running"', "holds a string, where an object was expected"),
    ("[" * 100_000 + "]" * 100_000, "nests deeper than"),
    ('{"state": "done", "step": "7"}', "the field 'step' holds '7'"),
    ('{"state": "done", "last_pass": {"eval/loss": "x"}}', "the field 'last_pass'"),
    ('{"state": ["done"]}', "the field 'state'"),
    ('{"state": "done", "eta_seconds": ' + "9" * 400 + "}", "the field 'eta_seconds'"),
])
def test_watch_of_a_status_file_that_is_no_status_object(tmp_path, capsys, text, says):
  path = tmp_path / "s.json"
  path.write_text(text)
  err = _ends(["watch", str(path), "--wait", "0.2"], capsys, code="E-METRICS-001",
              where=str(path))
  assert says in err and "waited: 0.2s" in err


@pytest.mark.parametrize("what", ["dev-zero", "fifo", "folder", "link-to-dev-zero"])
def test_watch_of_a_device_a_fifo_or_a_folder_is_refused_at_once(tmp_path, capsys, what):
  path = fc.hostile_files(str(tmp_path))[what]
  err = _ends(["watch", path, "--wait", "600"], capsys, code="E-METRICS-001", where=path,
              timeout=20)
  assert "not a regular file" in err


@pytest.mark.parametrize("flag, value", [
    ("--interval", "-1"), ("--interval", "0"), ("--interval", "nan"), ("--interval", "1e300"),
    ("--timeout", "-1"), ("--timeout", "0"), ("--wait", "-1"), ("--wait", "1e300"),
])
def test_watch_intervals_out_of_range(tmp_path, capsys, flag, value):
  path = tmp_path / "s.json"
  path.write_text('{"state": "running", "step": 1, "steps": 4}')
  _ends(["watch", str(path), flag, value], capsys, where=flag)


def test_watch_shows_non_finite_numbers_and_a_long_interval_keeps_the_timeout(tmp_path):
  import io
  from rich.console import Console
  from sexpgpu.tools.watch import watch
  path = tmp_path / "s.json"
  path.write_text('{"slug": "x", "state": "running", "step": 1, "steps": 4, '
                  '"train_loss": NaN, "eta_seconds": Infinity, "steps_per_second": 1e400}')
  console = Console(record=True, width=120, file=io.StringIO(), force_terminal=False)
  got = []
  t = threading.Thread(target=lambda: got.append(watch(str(path), 3600, console, timeout=0.5)),
                       daemon=True)
  t.start()
  t.join(30)
  assert got == [3]  # the hour between reads is cut to the half second left
  assert "step 1/4 loss nan eta -" in console.export_text()


# --- the fuzzer ----------------------------------------------------------------------------

def test_the_fuzz_oracle_catches_an_exit_0_for_a_bad_case(tmp_path):
  path = tmp_path / "s.json"
  path.write_text('{"state": "done", "step": 1, "steps": 1}')
  case = fc.Case(["watch", str(path), "--wait", "0.2"], bad="pretended bad")
  assert "exit 0 although the input holds an invalid value" in fc.feed(case, str(tmp_path))
  assert fc.feed(fc.Case(list(case), expect=0), str(tmp_path)) is None
  assert "where the status file says 2" in fc.feed(fc.Case(list(case), expect=2),
                                                   str(tmp_path))


@pytest.mark.slow  # fuzz
def test_fuzz_slice(ckpt, tmp_path):
  """40 hostile cases through sample, eval, plot and watch: none escapes, hangs or exits 0
  for a bad input (`python benchmarks/fuzz_commands.py --count 1000` runs more)."""
  fed, findings = fc.fuzz(40, seed=1, folder=str(tmp_path), ckpt=ckpt)
  assert fed == 40
  assert findings == []
  assert sum(v for (c, k), v in fc.fuzz_front.OUTCOMES.items() if k == 1) >= 20
