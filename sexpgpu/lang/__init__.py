"""Forms to a program: require, declarations, knobs, variants, selection, slug."""
