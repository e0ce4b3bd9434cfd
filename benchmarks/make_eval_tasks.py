"""Writes configs/data/choice.jsonl and configs/data/cloze.jsonl, the evaluation tasks that
`defeval` and `sexpgpu eval` ship with, from the shipped texts in configs/data/.

- choice.jsonl, multiple choice in lm-evaluation-harness's shape (`{"context", "choices",
  "gold"}`): the context is the start of a sentence of garden.txt or lighthouse.txt (text the
  `train` loader of configs/text-lm.sx trains on), the gold choice the one to three words that
  follow it there, and three distractors runs of one to three words from the other story.
  A model that has learnt the stories picks the gold; one that has not is at chance (1/4).
- cloze.jsonl, perplexity (`{"text"}`): the sentences of river.txt, the document that
  text-lm.sx's split [0.9 1] holds out of training, long ones cut at a comma or semicolon.

Every text is ASCII and fits, context and longest choice together, in a window of 64 tokens
of the 2048-token BPE that `sexpgpu tokenize configs/data/*.txt -o cache/ --train-bpe 2048`
trains (the script trains the same one and checks; --no-check skips it). The files are a
pure function of --seed: running the script again writes the same bytes.

  python benchmarks/make_eval_tasks.py [--seed 0] [--out configs/data] [--no-check]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "configs", "data")
SOURCES = ("corpus.txt", "garden.txt", "lighthouse.txt", "river.txt")  # what tokenize reads
CHOICE_FROM = ("garden.txt", "lighthouse.txt")
CLOZE_FROM = ("river.txt",)
WINDOW = 64        # tokens a request may take, context and continuation together
CUTS = 3           # questions a sentence, at most
MIN_CONTEXT = 4    # words before the cut
CLOZE_WORDS = 24   # a longer sentence is cut at a comma or semicolon
WORD = re.compile(r"[A-Za-z]+$")  # a choice's words: letters only, no punctuation or quotes
# A sentence ends at . ? ! (or one inside a closing quote) before a capital or an opening quote:
# `"Where are you going?" she asked.` stays one sentence.
SENTENCE_END = re.compile(r'(?<=[.?!])\s+(?=[A-Z"])|(?<=[.?!]")\s+(?=[A-Z"])')


def sentences(name: str) -> list[str]:
  """The sentences of configs/data/`name`, its title (a paragraph without a full stop) left
  out; a quotation of several sentences stays one."""
  text = open(os.path.join(DATA, name), encoding="ascii").read()
  out = []
  for para in re.split(r"\n\s*\n", text):
    para = " ".join(para.split())
    if not para or para[-1] not in '.?!"':
      continue
    for s in SENTENCE_END.split(para):
      if out and out[-1].count('"') % 2:  # inside a quotation: the sentence goes on
        out[-1] += " " + s
      else:
        out.append(s)
  return out


def runs(words: list[str], length: int, start: int = 1) -> list[int]:
  """The indices i >= start at which words[i:i+length] are all plain words."""
  return [i for i in range(start, len(words) - length + 1)
          if all(WORD.match(w) for w in words[i:i + length])]


def choice_docs(rng: random.Random) -> list[dict]:
  """Questions from the sentences of CHOICE_FROM: a sentence's start, and which of four runs
  of words goes on from it (the gold, and three from the other file's sentences)."""
  sents = [(name, s.split()) for name in CHOICE_FROM for s in sentences(name)]
  docs = []
  for name, words in sents:
    others = [w for n, w in sents if n != name]
    cuts = []
    for _ in range(CUTS):
      length = rng.choice((1, 2, 3))
      free = [i for i in runs(words, length, MIN_CONTEXT)
              if all(abs(i - j) > 3 for j, _ in cuts)]
      if free:
        cuts.append((rng.choice(free), length))
    for cut, length in sorted(cuts):
      context = " ".join(words[:cut])
      gold = " ".join(words[cut:cut + length])
      choices = []
      while len(choices) < 3:
        other = rng.choice(others)
        n = rng.choice((1, 2, 3))
        at = runs(other, n)
        if not at:
          continue
        text = " ".join(other[(i := rng.choice(at)):i + n])
        # never the gold, never twice, never another true way on from this context
        if text != gold and text not in choices and context + " " + text not in " ".join(words):
          choices.append(text)
      docs.append((context, gold, choices))
  # the gold as often in each place, so no habit of the model (the first, the shortest)
  # scores above chance
  places = [i % 4 for i in range(len(docs))]
  rng.shuffle(places)
  out = []
  for (context, gold, choices), g in zip(docs, places):
    out.append({"context": context, "choices": choices[:g] + [gold] + choices[g:], "gold": g})
  return out


def cloze_docs() -> list[dict]:
  """The sentences of CLOZE_FROM, each over CLOZE_WORDS words cut after a comma or semicolon
  into pieces of at least six words."""
  docs = []
  for name in CLOZE_FROM:
    for s in sentences(name):
      words, piece = s.split(), []
      for i, w in enumerate(words):
        piece.append(w)
        rest = len(words) - i - 1
        if (len(piece) >= CLOZE_WORDS // 2 and w[-1] in ",;" and rest >= 6
            and len(piece) + rest > CLOZE_WORDS):
          docs.append({"text": " ".join(piece)})
          piece = []
      docs.append({"text": " ".join(piece)})
  return docs


def check(choice: list[dict], cloze: list[dict]) -> int:
  """The most tokens any request takes under the 2048-token BPE of configs/data/*.txt.

  Raises:
    ValueError: a request that does not fit WINDOW tokens, or a text that is not ASCII.
  """
  # pylint: disable-next=import-outside-toplevel
  from sexpgpu.tools.tokenize import train_bpe
  texts = [open(os.path.join(DATA, n), encoding="utf-8").read() for n in SOURCES]
  tok = train_bpe(iter(texts), 2048, "<|endoftext|>")
  longest = 0
  for d in choice:
    for c in d["choices"]:
      longest = max(longest, len(tok.encode(d["context"] + " " + c).ids))
  for d in cloze:
    longest = max(longest, len(tok.encode(d["text"]).ids))
  for d in choice + cloze:
    json.dumps(d).encode("ascii")  # non-ASCII would raise here
  if longest > WINDOW:
    raise ValueError(f"a request takes {longest} tokens, more than the window of {WINDOW}")
  return longest


def write(path: str, docs: list[dict]) -> None:
  with open(path, "w", encoding="ascii", newline="\n") as f:
    for d in docs:
      f.write(json.dumps(d, ensure_ascii=True) + "\n")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=DATA, help="the folder to write the two files to")
  ap.add_argument("--no-check", action="store_true",
                  help="do not train the BPE to check that every request fits 64 tokens")
  a = ap.parse_args()
  choice = choice_docs(random.Random(a.seed))
  cloze = cloze_docs()
  longest = None if a.no_check else check(choice, cloze)
  write(os.path.join(a.out, "choice.jsonl"), choice)
  write(os.path.join(a.out, "cloze.jsonl"), cloze)
  print(f"choice.jsonl: {len(choice)} docs, cloze.jsonl: {len(cloze)} docs"
        + ("" if longest is None else f", the longest request {longest} tokens"))


if __name__ == "__main__":
  main()
