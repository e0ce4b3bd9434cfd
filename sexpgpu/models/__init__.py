"""Models in and out: the GPT-2 twin, export, import, warm start and sampling."""
