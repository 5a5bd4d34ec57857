"""Runtime modules that replace a model's routed experts."""
