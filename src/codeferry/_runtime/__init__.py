"""The content-addressed store, per-process private copies, the import finder and loader,
and pickling of remote classes by content."""
