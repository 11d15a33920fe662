"""``codeferry audit``: what a model's code does at import and call time, found statically."""
