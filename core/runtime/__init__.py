"""The target runner and the head step: static KV caches, compiled graphs per size, CPU linears."""
