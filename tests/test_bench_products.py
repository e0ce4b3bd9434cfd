"""benchmarks/bench_products.py times the products it says it times: each leg's chain is
the recipe's product in the form named, and a wrong one stops the benchmark."""

import os
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_products  # noqa: E402


@pytest.mark.parametrize("form", bench_products.FORMS)
def test_each_leg_chains_the_products_of_its_form(form):
  a, w, g = bench_products.operands(128, 78)
  assert a.shape == (16, 768, 128) and w.shape == (16, 128, 78) and g.shape == (16, 768, 78)
  want = bench_products.chain_numpy(form, a, w, g)
  for leg in (bench_products.leg_xla, bench_products.leg_torch):
    call, got = leg(form, a, w, g)
    call()
    assert len(got) == bench_products.CHAIN
    for x, y in zip(got, want):
      np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-3 * np.abs(y).max())
  # the chain is dependent: the second product differs from the first one's form alone
  first = {"A·W": a[1] @ w[1], "G·Wᵀ": g[1] @ w[1].T, "Aᵀ·G": a[1].T @ g[1]}[form]
  assert not np.allclose(want[1], first)


def test_a_step_multiplies_by_seventeen_weights_in_three_forms():
  # 4 layers × (qkv, attention out, MLP in, MLP out) + the tied head
  assert sum(count for _, count in bench_products.WEIGHTS) == 17
  us = {f"{k}x{n} {form}": 1.0 for (k, n), _ in bench_products.WEIGHTS
        for form in bench_products.FORMS}
  assert bench_products.step_sum(us) == pytest.approx(51 / 1e3)


def test_a_wrong_product_stops_the_benchmark(monkeypatch):
  monkeypatch.setattr(bench_products, "WEIGHTS", [((128, 78), 1)])
  monkeypatch.setattr(bench_products, "chain_numpy",
                      lambda form, a, w, g: [np.ones((768, 78))] * bench_products.CHAIN)
  with pytest.raises(SystemExit, match="differs from NumPy's float64 products"):
    bench_products.child("torch", 1, 1)


@pytest.mark.parametrize("argv, says", [(["--cores", "0"], "--cores"),
                                        (["--cores", "1,x"], "--cores takes counts"),
                                        (["--rounds", "0"], "--rounds and --reps"),
                                        (["--legs", "jax"], "--legs takes"),
                                        (["--json", "/no/such/folder/x.json"], "--json")])
def test_bad_flags_are_refused_by_the_parser(argv, says, capsys):
  with pytest.raises(SystemExit) as e:
    bench_products.main(argv)
  assert e.value.code == 2
  assert says in capsys.readouterr().err
