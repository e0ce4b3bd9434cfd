"""The graph IR: ops table, shape rules, the evaluator that builds graphs, printer."""
