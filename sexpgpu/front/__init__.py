"""The evaluator of `.sx` forms: a selected program's forms → graph IR and the experiment."""
