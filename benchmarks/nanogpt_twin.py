"""A PyTorch twin of nanoGPT's `train.py` and `model.py` on its shakespeare_char CPU recipe.

    python benchmarks/nanogpt_twin.py --text input.txt [--iters 2000] [--vocab V] [--json]

nanoGPT's README CPU line (`config/train_shakespeare_char.py --device=cpu --compile=False
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
--n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`), done as its files do:

- model.py: learned token and position embeddings (normal 0.02), pre-norm blocks of
  LayerNorm, `c_attn` (3C) with `F.scaled_dot_product_attention(is_causal=True)` (the fused
  kernel), `c_proj`, an MLP of `c_fc` (4C), `nn.GELU()` and `c_proj`; `c_proj` weights
  initialized with std 0.02/sqrt(2·n_layer); a final LayerNorm; `lm_head` tied to `wte`;
  mean cross-entropy. `--bias` as nanoGPT's `bias` flag (LayerNorm and Linear biases).
- train.py: AdamW with two groups (weight decay 0.1 on parameters of two or more
  dimensions, none on the rest), betas (0.9, 0.99), and on the CPU no `fused` argument (as
  nanoGPT passes it only on CUDA); lr linear warm-up over 100 iterations to 1e-3, then
  cosine to 1e-4 at iteration 2000; `clip_grad_norm_(1.0)`; `zero_grad(set_to_none=True)`;
  the next batch drawn right after the forward; an evaluation every 250 iterations
  (including iteration 0) of 20 random batches of each split; iterations 0..iters
  inclusive, as nanoGPT's loop runs them; torch's default threads.
- bias: std/gpt2 (configs/shakespeare-char.sx) has biases, so `--bias 1` is the default
  here (nanoGPT's recipe has bias=False); both models then hold the same parameters.
- data: the text's characters sorted as the vocabulary (sexpgpu's `text` loader's ids, its
  end-of-document id last, unused here: `--vocab` gives the tokenizer's size so both models
  have the same tables), 90/10 split by characters, random windows of block+1 characters.

It prints one JSON object: the wall clock (`time.time()`) at iteration 0 before its
evaluation (the start-up's end), each iteration's period (from
the end of the previous iteration to the end of this one, `loss.item()` on the host, as
nanoGPT's `dt`), which iterations held an evaluation, the parameter count (tied weights
once) and the final validation loss over the whole validation split (rows of block+1
characters laid end to end, the last partial row dropped).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

T_LAUNCH_IMPORTS = time.time()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


class LayerNorm(nn.Module):
  """nanoGPT's LayerNorm with an optional bias."""

  def __init__(self, ndim: int, bias: bool):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(ndim))
    self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

  def forward(self, x):
    return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Attention(nn.Module):
  """nanoGPT's CausalSelfAttention (the flash path: scaled_dot_product_attention)."""

  def __init__(self, width: int, heads: int, bias: bool):
    super().__init__()
    self.c_attn = nn.Linear(width, 3 * width, bias=bias)
    self.c_proj = nn.Linear(width, width, bias=bias)
    self.heads = heads

  def forward(self, x):
    b, t, c = x.size()
    q, k, v = self.c_attn(x).split(c, dim=2)
    k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
    q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
    v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
    return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
  """ln_1, attention, ln_2, MLP (c_fc, GELU, c_proj), each residual."""

  def __init__(self, width: int, heads: int, bias: bool):
    super().__init__()
    self.ln_1 = LayerNorm(width, bias)
    self.attn = Attention(width, heads, bias)
    self.ln_2 = LayerNorm(width, bias)
    self.mlp = nn.Sequential()
    self.mlp.c_fc = nn.Linear(width, 4 * width, bias=bias)
    self.mlp.gelu = nn.GELU()
    self.mlp.c_proj = nn.Linear(4 * width, width, bias=bias)

  def forward(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
  """nanoGPT's GPT: wte, wpe, blocks, ln_f, lm_head tied to wte."""

  def __init__(self, vocab: int, block: int, layers: int, heads: int, width: int, bias: bool):
    super().__init__()
    self.wte = nn.Embedding(vocab, width)
    self.wpe = nn.Embedding(block, width)
    self.h = nn.ModuleList([Block(width, heads, bias) for _ in range(layers)])
    self.ln_f = LayerNorm(width, bias)
    self.lm_head = nn.Linear(width, vocab, bias=False)
    self.wte.weight = self.lm_head.weight  # weight tying
    self.apply(self._init_weights)
    for name, p in self.named_parameters():
      if name.endswith("c_proj.weight"):
        torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

  @staticmethod
  def _init_weights(module):
    if isinstance(module, nn.Linear):
      torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
      if module.bias is not None:
        torch.nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
      torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

  def forward(self, idx, targets):
    t = idx.size(1)
    pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
    x = self.wte(idx) + self.wpe(pos)
    for block in self.h:
      x = block(x)
    logits = self.lm_head(self.ln_f(x))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

  def configure_optimizers(self, weight_decay: float, lr: float, betas):
    """nanoGPT's two groups: decay on ≥2-D parameters, none on the rest; AdamW unfused."""
    params = [p for p in self.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": nodecay, "weight_decay": 0.0}], lr=lr, betas=betas)


def parameter_count(vocab: int, block: int = 64, layers: int = 4, heads: int = 4,
                    width: int = 128, bias: bool = True) -> int:
  """The twin's parameter count (the tied table once, position table included)."""
  model = GPT(vocab, block, layers, heads, width, bias)
  return sum(p.numel() for p in model.parameters())


def get_lr(it: int, lr: float = 1e-3, min_lr: float = 1e-4, warmup: int = 100,
           decay_iters: int = 2000) -> float:
  """nanoGPT's get_lr: linear warm-up, cosine decay to min_lr, then min_lr."""
  if it < warmup:
    return lr * (it + 1) / (warmup + 1)
  if it > decay_iters:
    return min_lr
  ratio = (it - warmup) / (decay_iters - warmup)
  return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def char_data(path: str):
  """The text's ids (sorted characters) as one tensor, its distinct characters' count."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  chars = sorted(set(text))
  stoi = {c: i for i, c in enumerate(chars)}
  return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


def main(argv=None) -> int:
  """Trains the twin; prints its JSON record."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--text", required=True)
  ap.add_argument("--iters", type=int, default=2000)
  ap.add_argument("--vocab", type=int, default=0, help="tokenizer size (default: chars + 1)")
  ap.add_argument("--bias", type=int, default=1)
  ap.add_argument("--eval-interval", type=int, default=250)
  ap.add_argument("--eval-iters", type=int, default=20)
  ap.add_argument("--seed", type=int, default=1337)
  args = ap.parse_args(argv)
  block, batch, layers, heads, width = 64, 12, 4, 4, 128
  torch.manual_seed(args.seed)
  data, distinct = char_data(args.text)
  vocab = args.vocab or distinct + 1
  n = int(0.9 * len(data))
  splits = {"train": data[:n], "val": data[n:]}

  def get_batch(split):
    d = splits[split]
    ix = torch.randint(len(d) - block, (batch,))
    x = torch.stack([d[i:i + block] for i in ix])
    y = torch.stack([d[i + 1:i + 1 + block] for i in ix])
    return x, y

  model = GPT(vocab, block, layers, heads, width, bool(args.bias))
  optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99))

  @torch.no_grad()
  def estimate_loss():
    model.eval()
    out = {}
    for split in ("train", "val"):
      losses = torch.zeros(args.eval_iters)
      for k in range(args.eval_iters):
        x, y = get_batch(split)
        losses[k] = model(x, y).item()
      out[split] = losses.mean().item()
    model.train()
    return out

  periods, evals, t_first, losses = [], [], None, []
  x, y = get_batch("train")
  t_prev = time.perf_counter()
  for it in range(args.iters + 1):
    lr = get_lr(it, decay_iters=max(args.iters, 101))
    for group in optimizer.param_groups:
      group["lr"] = lr
    evaluated = it % args.eval_interval == 0
    if it == 0:
      t_first = time.time()  # step 0, before its evaluation: the start-up's end
    if evaluated:
      estimate_loss()
      if it == 0:
        t_prev = time.perf_counter()
    loss = model(x, y)
    x, y = get_batch("train")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item()
    t = time.perf_counter()
    periods.append(t - t_prev)
    t_prev = t
    losses.append(lossf)
    if evaluated:
      evals.append(it)

  val = splits["val"]
  rows = len(val) // (block + 1)
  with torch.no_grad():
    model.eval()
    total, count = 0.0, 0
    chunk = val[:rows * (block + 1)].view(rows, block + 1)
    for i in range(0, rows, batch):
      r = chunk[i:i + batch]
      total += model(r[:, :-1].contiguous(), r[:, 1:].contiguous()).item() * r.shape[0]
      count += r.shape[0]
  print(json.dumps({"t_first_step": t_first, "t_imports": T_LAUNCH_IMPORTS,
                    "periods": periods, "evals": evals, "loss_last": losses[-1],
                    "params": sum(p.numel() for p in model.parameters()),
                    "val_loss": total / count, "threads": torch.get_num_threads(),
                    "vocab": vocab}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
