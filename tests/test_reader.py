"""The reader: values, locations, and every read error's code, place and caret."""

import pytest

from sexpgpu.errors import SxError
from sexpgpu.reader import Atom, Keyword, List, Symbol, Vector, read_text
from test_std_namespace import _compile_error, _config


def read_err(text, name="t.sx"):
  with pytest.raises(SxError) as info:
    read_text(text, name)
  return info.value


def one(text):
  forms = read_text(text, "t.sx")
  assert len(forms) == 1
  return forms[0]


# ---- values ----------------------------------------------------------------

@pytest.mark.parametrize("tok,value", [
    ("12", 12), ("-3", -3), ("+7", 7), ("1_000", 1000), ("0", 0),
    ("3.5e-4", 3.5e-4), ("0.5", 0.5), ("-0.25", -0.25), (".5", 0.5), ("1e3", 1000.0),
    ("1_000.5", 1000.5),
    ("true", True), ("false", False), ("nil", None),
])
def test_numbers_and_constants(tok, value):
  v = one(tok).value
  assert v == value and type(v) is type(value)


@pytest.mark.parametrize("tok", ["eval/loss", "split-heads", "+", "-", "*", "/", "<=", "!=",
                                 "a.b", "x%", "ok?", "set!", "_x", "f32", "-x", "->"])
def test_symbols(tok):
  v = one(tok).value
  assert isinstance(v, Symbol) and str(v) == tok


@pytest.mark.parametrize("tok,name", [(":batch", "batch"), (":eval/loss", "eval/loss"),
                                      (":keep", "keep"), (":a-b", "a-b")])
def test_keywords(tok, name):
  v = one(tok).value
  assert isinstance(v, Keyword) and str(v) == name
  assert not isinstance(v, Symbol)


def test_strings_and_escapes():
  assert one(r'"a\nb\t\"q\"\\\0"').value == 'a\nb\t"q"\\\0'
  v = one('"multi\nline"').value
  assert v == "multi\nline" and not isinstance(v, Symbol)


def test_comments_and_commas():
  forms = read_text("; a comment\n(a, b) ; trailing\n[1,2]", "t.sx")
  assert [str(f) for f in forms] == ["(a b)", "[1 2]"]


def test_datum_comments_skip_one_form():
  forms = read_text("#; (skipped (nested [x])) (kept) #;dropped last", "t.sx")
  assert [str(f) for f in forms] == ["(kept)", "last"]
  assert str(one("(a #; b c)")) == "(a c)"
  assert str(one("(a #; #; b c d)")) == "(a d)"
  assert str(one("[x #;\n ; comment\n (y z) w]")) == "[x w]"


def test_lists_vectors_nesting():
  f = one("(defn f [x :k 1] (g x [b t d]))")
  assert isinstance(f, List) and isinstance(f.items[2], Vector)
  assert isinstance(f.items[3].items[2], Vector)
  assert str(f) == "(defn f [x :k 1] (g x [b t d]))"
  assert one("()").items == () and one("[]").items == ()


# ---- locations -------------------------------------------------------------

def loc4(form):
  l = form.loc
  return (l.line, l.col, l.end_line, l.end_col)


def test_locations_of_nested_forms():
  text = "(defn f [x]\n  (let [y (+ x 1)]\n    (* y  :k)))\n"
  f = one(text)
  assert f.loc.file == "t.sx"
  assert loc4(f) == (1, 1, 3, 16)  # end is exclusive
  assert loc4(f.items[0]) == (1, 2, 1, 6)           # defn
  assert loc4(f.items[2]) == (1, 9, 1, 12)          # [x]
  let = f.items[3]
  assert loc4(let) == (2, 3, 3, 15)
  binding = let.items[1]
  assert loc4(binding) == (2, 8, 2, 19)
  assert loc4(binding.items[1]) == (2, 11, 2, 18)   # (+ x 1)
  assert loc4(binding.items[1].items[2]) == (2, 16, 2, 17)
  body = let.items[2]
  assert loc4(body) == (3, 5, 3, 14)
  assert loc4(body.items[2]) == (3, 11, 3, 13)      # :k
  assert body.items[2].value == Keyword("k")


def test_locations_after_strings_and_comments():
  forms = read_text('"a\nbc" ; x\n  #; skip\n  z', "t.sx")
  assert loc4(forms[0]) == (1, 1, 2, 4)
  assert loc4(forms[1]) == (4, 3, 4, 4)


def test_location_str():
  assert str(one("\n  x").loc) == "t.sx:2:3"


# ---- read errors -----------------------------------------------------------

def test_unclosed_paren_names_where_it_opened():
  e = read_err("(def a 1)\n(defn f [x]\n  (g x)\n")
  assert e.code == "E-READ-001"
  assert (e.location.line, e.location.col) == (2, 1)
  assert "opened at line 2, column 1 is never closed" in e.message
  assert e.render() == "\n".join([
      "error[E-READ-001]: `(` opened at line 2, column 1 is never closed",
      "  --> t.sx:2:1",
      "  |",
      "2 | (defn f [x]",
      "  | ^",
      "   = fix: add `)` where the form should end",
  ])


def test_unclosed_vector_inside_list():
  e = read_err("(f [a b\n  c)")
  assert e.code == "E-READ-001"
  # `)` arrives while `[` is open: a mismatch at the `)`.
  assert (e.location.line, e.location.col) == (2, 4)
  e = read_err("(f\n  [a b")
  assert e.code == "E-READ-001" and (e.location.line, e.location.col) == (2, 3)
  assert "`[` opened at line 2, column 3 is never closed" in e.message


def test_unexpected_close():
  e = read_err("(a)\n  (b))\n")
  assert e.code == "E-READ-001"
  assert (e.location.line, e.location.col) == (2, 6)
  assert e.render() == "\n".join([
      "error[E-READ-001]: unexpected `)` with no form open",
      "  --> t.sx:2:6",
      "  |",
      "2 |   (b))",
      "  |      ^",
      "   = fix: remove the `)` or open a form before it",
  ])
  e = read_err("]")
  assert e.code == "E-READ-001" and (e.location.line, e.location.col) == (1, 1)
  assert "unexpected `]`" in e.message


def test_mismatched_bracket():
  e = read_err("(let [a 1)\n  a)")
  assert e.code == "E-READ-001"
  assert (e.location.line, e.location.col) == (1, 10)
  assert e.render() == "\n".join([
      "error[E-READ-001]: `)` closes the `[` opened at line 1, column 6",
      "  --> t.sx:1:10",
      "  |",
      "1 | (let [a 1)",
      "  |          ^",
      "   = fix: write `]` here, or open this form with `(`",
  ])
  e = read_err("(f x]")
  assert e.code == "E-READ-001" and (e.location.line, e.location.col) == (1, 5)
  assert "`]` closes the `(` opened at line 1, column 1" in e.message


def test_datum_comment_at_end():
  e = read_err("(a)\n#;")
  assert e.code == "E-READ-001" and (e.location.line, e.location.col) == (2, 1)


def test_unterminated_string():
  e = read_err('(def s\n   "abc\n')
  assert e.code == "E-READ-002"
  assert (e.location.line, e.location.col) == (2, 4)
  assert e.render() == "\n".join([
      "error[E-READ-002]: string never ends",
      "  --> t.sx:2:4",
      "  |",
      '2 |    "abc',
      "  |    ^",
      '   = fix: close the string with `"`',
  ])


def test_bad_escape():
  e = read_err('(def s "ab\\qc")')
  assert e.code == "E-READ-002"
  assert (e.location.line, e.location.col) == (1, 11)
  assert e.render() == "\n".join([
      "error[E-READ-002]: bad escape `\\q` in a string",
      "  --> t.sx:1:11",
      "  |",
      '1 | (def s "ab\\qc")',
      "  |           ^^",
      "   = fix: use one of \\n \\t \\r \\\" \\\\ \\0",
  ])


def test_backslash_at_end_of_file():
  e = read_err('"ab\\')
  assert e.code == "E-READ-002"


@pytest.mark.parametrize("text,tok,col", [
    ("(def n 12abc)", "12abc", 8),
    ("(f a#b)", "a#b", 4),
    ("(f :)", ":", 4),
    ("(f 1.2.3)", "1.2.3", 4),
    ("(f #x)", "#x", 4),
    ("(f :a@b)", ":a@b", 4),
])
def test_bad_tokens(text, tok, col):
  e = read_err(text)
  assert e.code == "E-READ-003"
  assert (e.location.line, e.location.col) == (1, col)
  assert e.location.end_col - e.location.col == len(tok)
  assert f"`{tok}` is no number, symbol or keyword" in e.message


def test_bad_token_render():
  e = read_err("(def n\n  12abc)")
  assert e.render() == "\n".join([
      "error[E-READ-003]: `12abc` is no number, symbol or keyword",
      "  --> t.sx:2:3",
      "  |",
      "2 |   12abc)",
      "  |   ^^^^^",
      "   = fix: a number is digits with an optional `.`, exponent and `_` separators; "
      "a symbol may not start with a digit",
  ])


def test_wide_line_numbers_pad_the_gutter():
  e = read_err("\n" * 11 + "(a))")
  assert e.render().splitlines()[2:5] == ["   |", "12 | (a))", "   |    ^"]


# --- long source lines in an error ---------------------------------------------------------

def _caret_under(rendered: str) -> tuple[str, str]:
  """The quoted source line and the text its caret marks."""
  lines = rendered.split("\n")
  i = next(i for i, l in enumerate(lines) if l.strip().startswith("|") and "^" in l)
  src, caret = lines[i - 1], lines[i]
  src_text = src.split(" | ", 1)[1]
  marks = caret.split("| ", 1)[1]
  start = len(marks) - len(marks.lstrip(" "))
  return src_text, src_text[start:start + len(marks.strip())]


def test_a_long_line_is_cut_around_the_column_and_the_caret_stays_on_the_name():
  filler = " ".join(["(+ 1 2)"] * 60)
  text = _config("tiny-lm.sx", "(next-token-loss (lm (lm-inputs t)) t)",
                 f"(do {filler} (next-token-los (lm (lm-inputs t)) t) {filler})")
  err = _compile_error(text)
  src, marked = _caret_under(str(err))
  assert marked == "next-token-los"
  assert src.startswith("...") and src.endswith("...") and len(src) == 106
  assert err.location.col > 400  # the column is still the true one


def test_the_start_and_end_of_a_long_line_are_cut_on_one_side_only():
  from sexpgpu.errors import Loc, register_source
  line = "(def a " + "1" * 300 + ") ; " + "x" * 200
  register_source("long.sx", line + "\r\n")
  first = SxError("E-FORM-001", "m", location=Loc("long.sx", 1, 2, 1, 5))
  src, marked = _caret_under(str(first))
  assert marked == "def" and src == line[:100] + "..."
  last = SxError("E-FORM-001", "m", location=Loc("long.sx", 1, len(line) - 9))
  src, marked = _caret_under(str(last))
  assert src == "..." + line[-100:] and marked == "x" * 10
  short = SxError("E-FORM-001", "m", location=Loc("long.sx", 1, 8, 1, 11))
  assert "1 | " + line[:100] + "...\n" in str(short)


# --- a keyword given twice ------------------------------------------------------------------

def test_a_keyword_given_twice_is_e_form_001_naming_both_places():
  err = _compile_error(_config("tiny-lm.sx", "(defrun :loss loss", "(defrun :seed 3 :loss loss"))
  assert err.code == "E-FORM-001"
  assert err.message == "keyword :seed is given twice (first at exp.sx:26:9)"
  assert str(err.location) == "exp.sx:28:24" and err.fix == "keep one :seed"
  err = _compile_error(_config("tiny-lm.sx", ":batch 4 :seed 7))", ":batch 4 :batch 8 :seed 7))"))
  assert err.code == "E-FORM-001" and "keyword :batch is given twice" in err.message
