"""Source locations, the one error type a user ever sees (SxError), and the one scrubber of
credentials in what a user sees (`scrub`)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import threading
import urllib.parse
from typing import Iterable, Sequence

from sexpgpu.catalogue import CATALOGUE

# The text of every file the reader has read, so an error can show its line.
_SOURCES: dict[str, str] = {}


def register_source(path: str, text: str) -> None:
  """Remembers the text of a file so errors can quote its lines."""
  _SOURCES[path] = text


def source_text(path: str) -> str | None:
  """The text registered for `path`, or None."""
  return _SOURCES.get(path)


@dataclasses.dataclass(frozen=True)
class Loc:
  """A span of `.sx` text: file, 1-based line and column, and where it ends."""

  file: str
  line: int
  col: int
  end_line: int = 0
  end_col: int = 0

  def __str__(self) -> str:
    return f"{self.file}:{self.line}:{self.col}"


class SxError(Exception):
  """A user's mistake, with its code, place and fix.

  Attributes:
    code: the catalogue code, such as "E-SHAPE-001" (`sexpgpu.catalogue`).
    message: one line saying what was found and what was expected.
    location: the `.sx` place (a Loc), or None for errors found outside a file.
    where: for errors outside a file, the flag, variable or location named.
    fix: how to fix it; the catalogue's fix for the code when a raise gives none.
    notes: further `= key: value` lines (operands, scope chain, ...).
  """

  def __init__(self, code: str, message: str, *, location: Loc | None = None,
               where: str | None = None, fix: str | None = None,
               notes: Sequence[tuple[str, str]] = ()):
    if code not in CATALOGUE:  # a programming error: every code is catalogued
      raise ValueError(f"error code {code!r} is not in sexpgpu/catalogue.py")
    # Every error a user sees is built here: its words are scrubbed of credentials once, so
    # the status file, the metrics stream and the API's exception carry none either.
    self.code = code
    self.message = scrub(message)
    self.location = location
    self.where = scrub(where) if where else where
    self.fix = scrub(fix if fix is not None else CATALOGUE[code].fix)
    self.notes = [(key, scrub(value)) for key, value in notes]
    super().__init__(self.render())

  def with_note(self, key: str, value: str) -> "SxError":
    """Adds a `= key: value` line and returns self (for re-raising)."""
    self.notes.append((key, scrub(value)))
    self.args = (self.render(),)
    return self

  def render(self) -> str:
    """The text printed on standard error, as in the error catalogue, without credentials
    (a field changed after the error was made is scrubbed here too)."""
    return scrub(self._render())

  def _render(self) -> str:
    lines = [f"error[{self.code}]: {self.message}"]
    if self.location is not None:
      lines.append(f"  --> {self.location}")
      lines.extend(_quote(self.location))
    elif self.where:
      lines.append(f"  --> {self.where}")
    for key, value in self.notes:
      lines.append(f"   = {key}: {value}")
    if self.fix:
      lines.append(f"   = fix: {self.fix}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.render()


# A file the reader did not read (a task file, a metrics stream) is read for its quoted line
# up to this many bytes, each line up to QUOTE_LINE_BYTES: an error near the end of a huge
# file, or on a line of megabytes, is told without its quote rather than read whole.
QUOTE_FILE_BYTES = 64 << 20
QUOTE_LINE_BYTES = 1 << 20


def _file_line(path: str, number: int) -> str | None:
  """Line `number` (from 1) of a regular file, read within the bounds above, or None."""
  import stat  # pylint: disable=import-outside-toplevel
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
  except (OSError, ValueError):
    return None
  with os.fdopen(fd, "rb") as f:
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      return None
    read = 0
    for n in range(1, number + 1):
      try:
        line = f.readline(QUOTE_LINE_BYTES + 1)
      except OSError:
        return None
      read += len(line)
      if not line or read > QUOTE_FILE_BYTES or len(line) > QUOTE_LINE_BYTES:
        return None
      if n == number:
        try:
          return line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
          return None
  return None


def _quote(loc: Loc) -> list[str]:
  text = source_text(loc.file)
  if text is not None:
    src_lines = text.split("\n")
    line = src_lines[loc.line - 1].rstrip("\r") if 1 <= loc.line <= len(src_lines) else None
  else:
    line = _file_line(loc.file, loc.line) if loc.line >= 1 else None
  if line is None:
    return []
  num = str(loc.line)
  pad = " " * (len(num) + 1)
  start = max(0, min(loc.col - 1, len(line)))
  if loc.end_line == loc.line and loc.end_col > loc.col:
    width = loc.end_col - loc.col
  else:
    width = max(1, len(line) - start)
  shown, caret_at, width = _window(line, start, width)
  return [f"{pad}|", f"{num} | {shown}", f"{pad}| {' ' * caret_at}{'^' * width}"]


# A quoted line longer than this is cut around the error's column, as rustc cuts it.
QUOTE_WIDTH = 100
_BEFORE = 40  # characters kept before the column when a line is cut


def _window(line: str, start: int, width: int) -> tuple[str, int, int]:
  """The part of `line` to quote: (text, where the caret starts in it, the caret's width).

  A line up to QUOTE_WIDTH characters is quoted whole; a longer one is cut to QUOTE_WIDTH
  characters around `start`, each cut side marked `...`, and the caret is clipped to what
  is shown.
  """
  if len(line) <= QUOTE_WIDTH:
    return line, start, max(1, width)
  lo = max(0, start - _BEFORE)
  hi = min(len(line), lo + QUOTE_WIDTH)
  lo = max(0, hi - QUOTE_WIDTH)
  head = "..." if lo > 0 else ""
  tail = "..." if hi < len(line) else ""
  return (head + line[lo:hi] + tail, len(head) + start - lo,
          max(1, min(width, hi - start)))


def nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
  """The candidates closest to `name`, best first (for "did you mean")."""
  return difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.5)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
  """A fix suggestion naming the nearest candidates, or "" when none is near."""
  near = nearest(name, candidates)
  if not near:
    return ""
  return "did you mean " + " or ".join(f"`{c}`" for c in near) + "?"


# --- credentials in text: the one scrubber -----------------------------------------------------
# Every writer of what a user sees passes its text through `scrub`: SxError's words (above),
# the lines of standard output and error (run/output.py's `write`), the status file, every
# metrics event, a checkpoint's meta, the --json summary and SEXPGPU_DEBUG's tracebacks. It lives
# here, below every layer, so that the language's slug (lang/select.py) can use it too;
# sexpgpu.paths re-exports it.
#
# The parse rule, for `scheme://USERINFO@HOST...` inside any text:
#   * a URI starts at `scheme://` and ends at white space, a quote, a bracket, `|`, `\`, or
#     where the next `scheme://` starts (`mlflow:http://a@h,mlflow:http://b@g` is two);
#   * its userinfo is everything between `://` and the LAST `@` of the URI that is followed by
#     a host-like token (a name, an IPv4 or [IPv6] address, an optional :port, possibly empty)
#     ending at `/`, `?`, `#`, `,`, `;` or the URI's end. So `/`, `@`, `+` and `:` inside a
#     secret (`s3://AKIA:SEC/RET+x@bucket/p`, common in AWS keys) are masked whole. A key that
#     itself holds `@` (`s3://bucket/run@v2/x`) is masked up to that `@` too: a hidden part of
#     a path is the price of never showing a secret;
#   * a query parameter (after `?`, `&` or `;`) whose name holds token, sig, key, pass, pwd,
#     secret, credential, auth, session or jwt (X-Amz-Security-Token, X-Amz-Signature, token,
#     access_token, sig, key, password, ...) has its value masked; the value ends at `&`, `#`,
#     `,`, `;`, or what ends a URI.
# A credential once seen is remembered for the process (the whole userinfo, its parts split at
# `:`, `/` and `@` of 4 characters or more, query values of 8 or more, each also URL-decoded),
# so a library that repeats it elsewhere (botocore naming the bucket `AKIA:SEC`) is masked too;
# so are the values of the credential variables below.
_SCHEME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
_URI_END = re.compile(r"[\s\"'`<>()\[\]{}|\\]")
_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]*\]|[A-Za-z0-9._~%\-]*)(?::\d*)?(?:[/?#,;]|$)")
_VALUE = r"[^&#\s\"'`<>()\[\]{}|\\,;]"  # a character of a query value
_PARAM = re.compile(r"([?&;])([^=?" + _VALUE[2:] + r"+)=(" + _VALUE + "*)")
_CREDENTIAL_NAME = re.compile(r"token|sig|key|pass|pwd|secret|credential|auth|session|jwt", re.I)
# Signed-URL keys written outside a query (a library's message quoting one).
_SIGNED = re.compile(r"((?:X-Amz|X-Goog)-(?:Signature|Credential|Security-Token)=)"
                     + _VALUE + "+", re.I)
MASK = "***"
_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN",
                "GOOGLE_APPLICATION_CREDENTIALS", "MLFLOW_TRACKING_PASSWORD",
                "MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY", "HF_TOKEN")
# Every URI credential scrub has met in this process, oldest first, at most _SEEN_MOST (a
# process that meets endless ones, a fuzzer, keeps the newest), and the same longest first.
_SEEN_SECRETS: dict[str, None] = {}
_SEEN_MOST = 64  # each costs a pass over every text scrubbed
_SEEN_ORDER: list[str] = []
_SEEN_LOCK = threading.Lock()


def _uri_spans(text: str) -> list[tuple[int, int]]:
  """(start, end) of what follows `scheme://` in each URI of `text` (linear in its length)."""
  found = []  # (where the scheme starts, where its `://` ends)
  i = text.find("://")
  while i >= 0:
    j = i
    while j > 0 and text[j - 1] in _SCHEME_CHARS:
      j -= 1
    while j < i and not text[j].isalpha():  # a scheme starts with a letter
      j += 1
    if j < i:
      found.append((j, i + 3))
    i = text.find("://", i + 3)
  out = []
  for k, (_, after) in enumerate(found):
    limit = found[k + 1][0] if k + 1 < len(found) else len(text)
    stop = _URI_END.search(text, after, limit)
    out.append((after, stop.start() if stop else limit))
  return out


def _userinfo_end(text: str, start: int, end: int) -> int | None:
  """Where the userinfo of the URI text[start:end] ends (its last `@` before a host), or None."""
  at = text.rfind("@", start, end)
  while at >= 0:
    if _HOST.match(text, at + 1, end):
      return at
    at = text.rfind("@", start, at)
  return None


def _userinfos(text: str) -> list[tuple[int, int]]:
  """(start, end) of each URI userinfo in `text`, without its `@`."""
  out = []
  for start, end in _uri_spans(text):
    at = _userinfo_end(text, start, end)
    if at is not None:
      out.append((start, at))
  return out


def _remember(userinfos: list[str], values: list[str]) -> None:
  new = set()
  for info in userinfos:
    for text in {info, urllib.parse.unquote(info)}:
      new.add(text)
      new.update(p for p in text.split(":") if len(p) >= 4)
      if ":" in text or "/" not in text:  # user:secret, or one token: its pieces are secret
        new.update(p for p in re.split(r"[:/@]", text) if len(p) >= 4)
        new.add(text.split("/", 1)[0])  # what an S3 client calls the bucket
  for value in values:
    new.update(v for v in {value, urllib.parse.unquote(value)} if len(v) >= 8)
  new = {s for s in new if len(s) >= 4 and s != MASK}
  with _SEEN_LOCK:
    if new - _SEEN_SECRETS.keys():
      _SEEN_SECRETS.update(dict.fromkeys(sorted(new)))
      while len(_SEEN_SECRETS) > _SEEN_MOST:
        del _SEEN_SECRETS[next(iter(_SEEN_SECRETS))]
      _SEEN_ORDER[:] = sorted(_SEEN_SECRETS, key=len, reverse=True)


def credential_param(name: str) -> bool:
  """Whether a query parameter of this name carries a credential (token, sig, key, ...)."""
  return bool(_CREDENTIAL_NAME.search(name))


def scrub(text, known: list[str] | None = None) -> str:
  """`text` without credentials: the one place secrets are masked in what a user sees.

  A URI's userinfo (`user:secret@`, however many `/`, `@`, `+` or `:` the secret holds)
  becomes `***@`; a credential query parameter's value (`?X-Amz-Security-Token=`, `&sig=`,
  `?token=`, ...) becomes `***`; credentials seen before in this process and the values of
  the credential variables (AWS_SECRET_ACCESS_KEY, ...) become `***`. The rule is written
  above this function in sexpgpu/errors.py.

  Args:
    text: anything; it is shown as str(text).
    known: `known_secrets()` read once by a caller scrubbing many texts (a metrics event's);
      None reads it here.

  Returns:
    The text with every credential masked.
  """
  text = str(text)
  if may_teach(text):
    text = _mask_uris(text)
    known = None
  for secret in known_secrets() if known is None else known:
    if secret in text:
      text = text.replace(secret, MASK)
  return text


def may_teach(text: str) -> bool:
  """Whether `text` may hold a URI or a query parameter: what scrub masks by its form, and
  remembers (so `known_secrets()` read before it may be out of date after it)."""
  return "://" in text or "=" in text


def known_secrets() -> list[str]:
  """What `scrub` masks wherever it appears: the credentials met in this process (longest
  first) and the credential variables' values."""
  with _SEEN_LOCK:
    seen = list(_SEEN_ORDER)
  return seen + [v for v in map(os.environ.get, _SECRET_VARS) if v and len(v) >= 4]


def _mask_uris(text: str) -> str:
  """`text` with each URI's userinfo and each credential query value masked, remembered."""
  infos, pieces, pos = [], [], 0
  for start, end in _userinfos(text):
    infos.append(text[start:end])
    pieces += [text[pos:start], MASK]
    pos = end
  text = "".join(pieces) + text[pos:]
  values = []

  def mask(m: re.Match) -> str:
    sep, name, value = m.groups()
    if not credential_param(name):
      return m.group(0)
    values.append(value)
    return f"{sep}{name}={MASK}"

  text = _SIGNED.sub(lambda m: m.group(1) + MASK, _PARAM.sub(mask, text))
  _remember(infos, values)
  return text


def without_credentials(text: str) -> str:
  """`text` with every URI's userinfo (and its `@`) and every credential query parameter
  removed, not masked (`s3://K:S@b/x?token=T&v=2` → `s3://b/x?v=2`): what names a thing
  whatever credentials reach it, as a run's slug and a data cache's key do. Only the URI
  form is removed (nothing remembered or read from the environment), so the result is the
  same in every process; what is removed is remembered, as `scrub` remembers it."""
  text = str(text)
  scrub(text)  # what it removes is remembered, as scrub remembers it
  pieces, pos = [], 0
  for start, end in _userinfos(text):
    pieces.append(text[pos:start])
    pos = end + 1
  text = "".join(pieces) + text[pos:]
  text = _PARAM.sub(lambda m: ("\0" if m.group(1) == "?" else "")
                    if credential_param(m.group(2)) else m.group(0), text)
  text = re.sub("\0[&;]+", "?", text)  # the first parameter went: the next one leads
  return text.replace("\0", "")  # the only one went, and its `?` with it


def credentials_in(text: str) -> list[str]:
  """What credentials `text` carries in URI form, in words: `a user:secret@ part` and each
  credential query parameter (`the query parameter X-Amz-Signature`); [] when none."""
  text = str(text)
  found = ["a user:secret@ part"] if _userinfos(text) else []
  found += [f"the query parameter {m.group(2)}" for m in _PARAM.finditer(text)
            if credential_param(m.group(2))]
  return found


def traceback_text(exc: BaseException) -> str:
  """`exc`'s traceback with its causes, as Python prints it, scrubbed: what SEXPGPU_DEBUG=1
  shows (every traceback sexpgpu prints goes through here)."""
  import traceback  # pylint: disable=import-outside-toplevel
  return scrub("".join(traceback.format_exception(exc)))
