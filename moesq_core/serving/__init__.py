"""Runtime modules: the experts modules that replace a model's routed experts, and the static-cache decode step
that `moesq generate` and the decode benchmark run."""
