"""``install()``/``uninstall()``, adopting transformers-loaded code, the model_type guard and the
vLLM plugin: after-load callbacks, never called back into."""
