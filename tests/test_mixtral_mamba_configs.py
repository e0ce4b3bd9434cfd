"""configs/mixtral-tiny.sx and configs/mamba-tiny.sx: their smoke variants train (the loss
falls), and their published shapes have the published parameter counts and config.json
values, counted from the graph without allocating a parameter."""

import json
import os

import numpy as np
import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.models.twin import find
from sexpgpu.run.compile import compile_file

CONFIGS = os.path.join(ROOT, "configs")
MIXTRAL_8X7B = 46_702_792_704  # Mixtral-8x7B's published count
MAMBA_130M = 129_135_360  # MambaForCausalLM of state-spaces/mamba-130m-hf's config (tied head)


def _published(name, variant):
  c = compile_file(os.path.join(CONFIGS, f"{name}.sx"), variant=variant)
  return sum(p.count for p in c.params.values()), find(c.params, c.stages[0].graph,
                                                       "test").config


def test_mixtral_8x7b_has_its_published_parameter_count_and_config():
  count, cfg = _published("mixtral-tiny", "mixtral-8x7b")
  assert count == MIXTRAL_8X7B
  # Mixtral-8x7B-v0.1's config.json, key for key
  assert {k: cfg[k] for k in (
      "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "num_local_experts",
      "num_experts_per_tok", "max_position_embeddings", "rope_theta", "rms_norm_eps",
      "router_aux_loss_coef", "tie_word_embeddings")} == {
      "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
      "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
      "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
      "rope_theta": 1e6, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.02,
      "tie_word_embeddings": False}


def test_mixtrals_top_k_and_aux_weight_are_read_from_its_graph():
  c = compile_file(os.path.join(CONFIGS, "mixtral-tiny.sx"), variant="smoke",
                   sets=[("experts-per-token", "1"), ("router-aux", "0.05")])
  cfg = find(c.params, c.stages[0].graph, "test").config
  assert (cfg["num_experts_per_tok"], cfg["router_aux_loss_coef"], cfg["num_local_experts"],
          cfg["head_dim"]) == (1, 0.05, 4, 8)


def test_mamba_130m_has_its_published_parameter_count_and_config():
  count, cfg = _published("mamba-tiny", "mamba-130m")
  assert count == MAMBA_130M
  # state-spaces/mamba-130m-hf's config.json
  assert {k: cfg[k] for k in (
      "vocab_size", "hidden_size", "num_hidden_layers", "state_size", "conv_kernel",
      "expand", "intermediate_size", "time_step_rank", "layer_norm_epsilon",
      "tie_word_embeddings")} == {
      "vocab_size": 50280, "hidden_size": 768, "num_hidden_layers": 24, "state_size": 16,
      "conv_kernel": 4, "expand": 2, "intermediate_size": 1536, "time_step_rank": 48,
      "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}


def test_the_published_counts_are_transformers_own():
  # the twins built on PyTorch's meta device (no memory) from the same config.json values
  import torch
  import transformers as t
  with torch.device("meta"):
    mamba = t.MambaForCausalLM(t.MambaConfig(vocab_size=50280, hidden_size=768,
                                             num_hidden_layers=24, state_size=16,
                                             conv_kernel=4, expand=2, time_step_rank=48))
    mixtral = t.MixtralForCausalLM(t.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        max_position_embeddings=32768))
  assert sum(p.numel() for p in mamba.parameters()) == MAMBA_130M
  assert sum(p.numel() for p in mixtral.parameters()) == MIXTRAL_8X7B


@pytest.mark.slow  # trains mixtral-tiny and mamba-tiny
@pytest.mark.parametrize("name", ["mixtral-tiny", "mamba-tiny"])
def test_the_smoke_variant_trains(name, tmp_path):
  m = tmp_path / "m.jsonl"
  s = sexpgpu.compile(os.path.join(CONFIGS, f"{name}.sx"), variant="smoke").run(
      metrics=f"jsonl:{m}")
  events = [json.loads(line) for line in m.read_text().splitlines()]
  steps = [e["train/loss"] for e in events if e["kind"] == "step"]
  passes = [e for e in events if e["kind"] == "pass"]
  assert s.steps == 60 and [p["step"] for p in passes] == [0, 20, 40, 60]
  first, last = passes[0]["metrics"]["eval/loss"], passes[-1]["metrics"]["eval/loss"]
  assert last < 0.8 * first, (first, last)
  assert np.mean(steps[-5:]) < np.mean(steps[:5]), steps


@pytest.mark.slow  # a benchmark at its tiny shape
def test_bench_decode_mamba_tiny_smoke(tmp_path):
  import subprocess
  import sys
  from conftest import BENCH_XLA_FLAGS
  out = tmp_path / "decode.json"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_decode.py"),
                      "--model", "mamba", "--shape", "tiny", "--tokens", "16", "--rounds", "1",
                      "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                     timeout=300, env=dict(os.environ, XLA_FLAGS=BENCH_XLA_FLAGS))
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert "ratio decode incremental/hand " in r.stdout and "tokens agree: all legs" in r.stdout
  res = json.loads(out.read_text())
  # generate's tokens, sexpgpu's compiled decoder's and the hand recurrent decoder's agree
  assert len(res["ids"]) == 16 and set(res["legs"]) == {"incremental", "hand"}
  assert res["agree"] == {"incremental (generate)": True, "incremental": True, "hand": True}
