"""The paper plan (`check --target cuda --gpu G --devices N`) held against published training
runs: each run configured as it was (model, sequence, batch, layout, remat), its published
throughput and the plan's prediction side by side.

  python benchmarks/plan_vs_published.py            # the table, as in benchmarks/README.md

Nothing here is fitted to a row: the plan's parameters are run/planning/gpu_cost.py's datasheet and
microbenchmark figures. tests/test_gpu_cost.py recomputes the table from the configs.
"""

from __future__ import annotations

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Row:
  """One published run: how to express it, what was published and where."""

  name: str
  config: str
  sets: dict
  gpu: str
  devices: int
  nodes: int
  metric: str  # "tokens/s a GPU" or "MFU"
  published: float
  source: str
  differs: str  # what the expression cannot match of the published run
  evals: float = 0.0  # forward-only microbatches of evaluation the run timed, a train step


ROWS = [
    Row("torchtitan Llama 3.1 8B, 8 × H100, FSDP, bf16, seq 8192", "configs/llama3-8b.sx",
        {"sharding": "fsdp", "batch": 2, "microbatches": 8, "remat": "true"}, "H100", 8, 1,
        "tokens/s a GPU", 5762,
        "torchtitan docs/performance.md, Table 1 (FSDP, local batch 2, global 16, selective "
        "activation checkpointing)",
        "torchtitan recomputes selected ops (here: every block); its H100s are the 96 GB HBM2e "
        "part (2.4 TB/s) at a 500 W power limit; eager PyTorch, no fusion"),
    Row("MaxText Llama 3 70B, 128 × H100 (16 nodes), FSDP 128, bf16, seq 8192",
        "configs/llama3-70b.sx",
        {"sharding": "fsdp", "batch": 2, "microbatches": 128, "remat": "true"}, "H100", 128, 16,
        "tokens/s a GPU", 134752.43 / 128,
        "NVIDIA DGX Cloud Benchmarking recipe 'Maxtext Llama3 70B' README (BF16, 128 GPUs: "
        "dcn_FSDP 16 × ici_FSDP 8, per_device_batch_size 2, GBS 256, GA 1; 15.563 s a step, "
        "134,752 tokens/s, 51.20% MFU)",
        "MaxText's remat policy is not in the table: here every block is recomputed; "
        "MaxText's GPU recipe tunes XLA's scheduler with PGLE"),
    Row("MaxText Llama 3.1 70B, 256 × H200 (32 nodes), data 2 × FSDP 128, bf16, seq 8192",
        "configs/llama3-70b.sx",
        {"sharding": "data:2,fsdp:128", "batch": 2, "microbatches": 256, "remat": "true"},
        "H200", 256, 32, "tokens/s a GPU", 1055.949,
        "Google Cloud's AI-Hypercomputer/gpu-recipes, training/a3ultra/llama-3.1-70b/"
        "maxtext-pretraining-gke/README.md (A3 Ultra, 32 nodes of 8 × H200: 'completed step: "
        "12, seconds: 15.516, TFLOP/s/device: 508.371, Tokens/s/device: 1055.949', MFU 51.4% of "
        "989) with its config src/frameworks/a3ultra/maxtext-configs/"
        "llama-3.1-70b-256gpus-a3u-bf16.yaml (dcn_data 2 × dcn_fsdp 16 × ici_fsdp 8, "
        "per_device_batch_size 2, attention cudnn_flash_te)",
        "MaxText's remat policy save_dot_with_context_except_mlp keeps the attention's "
        "products; here every block is recomputed"),
    Row("llm.c GPT-2 124M, 8 × A100, data parallel, bf16, seq 1024", "configs/gpt2-small.sx",
        {"batch": 64, "microbatches": 8, "precision": "bf16"}, "A100", 8, 1,
        "tokens/s a GPU", 524288 / 0.300 / 8,
        "llm.c scripts/run_gpt2_124M.sh (-b 64 -t 1024, 524,288 tokens a step on 8 × A100 80GB "
        "SXM, '~300ms/iter')",
        "llm.c shards the optimizer state (ZeRO-1, -z 1), here each GPU keeps all of it; "
        "its vocabulary is padded to 50,304"),
    Row("llm.c GPT-2 1558M, 8 × H100, data parallel, bf16, seq 1024", "configs/gpt2-small.sx",
        {"width": 1600, "layers": 48, "heads": 25, "batch": 16, "microbatches": 64,
         "precision": "bf16"}, "H100", 8, 1,
        "tokens/s a GPU", 1048576 / 2.80 / 8,
        "llm.c scripts/run_gpt2_1558M.sh (-b 16 -t 1024, 1,048,576 tokens a step on 8 × H100 "
        "80GB SXM, 'steps in 2.80s/iter')",
        "llm.c shards the optimizer state (ZeRO-1); here the plan's layout"),
    Row("nanoGPT baby GPT (shakespeare_char), 1 × A100, bf16", "configs/gpt2-small.sx",
        {"vocab": 65, "width": 384, "layers": 6, "heads": 6, "seq": 256, "context": 256,
         "batch": 64, "microbatches": 1, "precision": "bf16"}, "A100", 1, 1,
        "tokens/s a GPU", 64 * 256 * 5000 / 180,
        "nanoGPT README (train_shakespeare_char.py: 5000 iterations of 64 × 256 tokens "
        "'about 3 minutes' on one A100)",
        "the 3 minutes include nanoGPT's evals (every 250 iterations) and compile; dropout 0 "
        "here (0.2 there); std's gpt2 has biases",
        # its evals: iterations 0, 250, …, 5000, each 200 batches of train and of val
        evals=21 * 2 * 200 / 5000),
]


def predict(row: Row) -> dict:
  """The plan's prediction for a row: {"tokens/s a GPU", "MFU", "step", "terms", "layout"}."""
  sys.path.insert(0, ROOT)
  from sexpgpu import api
  from sexpgpu.run.planning import layout_plan
  c = api.compile(os.path.join(ROOT, row.config), set=row.sets)._c
  choice = layout_plan.paper(c, row.gpu, row.devices, row.nodes)
  t = choice.chosen.time
  terms = dict(choice.chosen.terms or {})
  if row.evals:  # a forward is a third of a step's matmul, memory-bound and launch terms
    fwd = sum(terms.get(k, 0.0) for k in ("matmul", "attention", "memory-bound", "overhead"))
    terms["evals"] = row.evals * fwd / 3
    t += terms["evals"]
  return {"tokens/s a GPU": choice.tokens / t / choice.devices,
          "MFU": choice.flops / (choice.devices * choice.hardware_peak * t),
          "step": t, "terms": terms, "layout": choice.chosen.name}


def off(row: Row, got: dict) -> float:
  """The prediction's relative miss: predicted / published − 1."""
  return got[row.metric] / row.published - 1


def _fmt(metric: str, v: float) -> str:
  return f"{100 * v:.1f}%" if metric == "MFU" else f"{v:,.0f}"


def table(results) -> str:
  """The README's markdown table from (row, prediction) pairs."""
  out = ["| run | metric | published | plan | miss | layout | step terms (a device) | source |",
         "| --- | --- | ---: | ---: | ---: | --- | --- | --- |"]
  for row, got in results:
    terms = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in got["terms"].items() if v)
    out.append(f"| {row.name} | {row.metric} | {_fmt(row.metric, row.published)} | "
               f"{_fmt(row.metric, got[row.metric])} | {100 * off(row, got):+.0f}% | {got['layout']} | {terms} | "
               f"{row.source} |")
  return "\n".join(out)


if __name__ == "__main__":
  print(table([(r, predict(r)) for r in ROWS]))
