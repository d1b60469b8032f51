"""Entry point Bazel's py_test targets use: run pytest on the test file given as argument."""
import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
