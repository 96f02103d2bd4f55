"""The reference serving engine's pieces that sit on top of kvproc (tiny models, and later the engine loop)."""
