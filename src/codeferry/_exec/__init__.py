"""Workers, the engine in them, batching, generation paths, transports (local, zygote, Ray),
the scheduler and ``Executor``."""
