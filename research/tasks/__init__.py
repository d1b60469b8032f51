"""Seeded task suites with programmatic answer checking (for test-time search)."""
from research.tasks.arithmetic import ArithmeticChains, Problem

__all__ = ["ArithmeticChains", "Problem"]
