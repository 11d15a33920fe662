"""The box around every process that runs model code: Landlock and a seccomp filter, applied
by the process to itself (``box.enter``) before the model's code is imported.

``policy`` says what is allowed (pure), ``landlock`` and ``seccomp`` are the ``ctypes``
layers over the kernel's calls, ``box`` enforces a policy and names what it refused.
"""
