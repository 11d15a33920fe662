"""Static knowledge of a model's code: auto_map, the import graph, where files are, digests,
the lock file, audit and resolve. No transformers import, no processes."""
