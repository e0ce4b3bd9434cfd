"""Training: the compile pipeline, the loop, passes, curriculum, signals, output lines."""
