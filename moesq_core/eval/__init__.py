"""Evaluation: perplexity and lm-eval task accuracy."""
