"""Evaluation: perplexity over held-out text."""
