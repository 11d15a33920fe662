"""The one trust decision, this process's policy, and the options object that carries them."""
