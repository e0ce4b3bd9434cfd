"""The graph IR: ops table with reference rules, shape rules, verifier, printer, rewrites."""
